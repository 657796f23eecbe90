"""`minite convert export-nvfp4` writes ModelOpt NVFP4 tensors that hold exactly the learner's quantised weights.

The learner quantises with 16x16 blocks; ModelOpt names 1x16 blocks. Repeating each 16x16 block's scale over its 16
rows gives a 1x16 grid with the same values, so the export is lossless: these tests compare bits, not tolerances.
No SGLang needed (the export is plain torch + safetensors).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.rollout.sglang.conftest import tiny_hf_checkpoint


def _recipe():
    from minite.nvfp4 import NVFP4Recipe

    return NVFP4Recipe()


@pytest.mark.parametrize("shape", [(16, 16), (48, 64), (128, 32)])
def test_16x16_scale_grid_expands_exactly_to_1x16(shape):
    from minite.nvfp4.modelopt import scale_grid_1x16
    from minite.ops import quantize_weight
    from minite.nvfp4 import NVFP4Tensor, gemm

    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[0])[:, None]).to(torch.bfloat16)
    w[0, :3] = 0
    q = quantize_weight(w, _recipe(), backend="reference")
    assert q.block == (16, 16)
    q1 = NVFP4Tensor(q.data, scale_grid_1x16(q), q.global_scale, q.shape, (1, 16), amax=q.amax)
    assert torch.equal(q1.dequantize().view(torch.int32), q.dequantize().view(torch.int32))
    x = _recipe().activation.quantize(torch.randn(5, shape[1], generator=g), backend="reference")
    assert torch.equal(gemm(x, q1).view(torch.int32), gemm(x, q).view(torch.int32))


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _modelopt_dequant(t, prefix):
    """A ModelOpt-style loader, written here without minite: e2m1(code) * scale * weight_scale_2 in fp32; also
    checks that weight_scale_2 is fl(amax / 2688) of the exported amax."""
    data, scale, s2 = t[prefix + ".weight"], t[prefix + ".weight_scale"], t[prefix + ".weight_scale_2"]
    amax = t[prefix + ".weight_scale_amax"]
    assert data.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn and s2.dtype == torch.float32
    assert s2.shape == () and scale.shape == (data.shape[0], data.shape[1] * 2 // 16)
    assert amax.dtype == torch.float32 and torch.equal(s2.view(torch.int32), (amax / 2688.0).view(torch.int32))
    codes = torch.stack([data & 15, data >> 4], dim=-1).reshape(data.shape[0], -1).long()
    return _E2M1[codes] * scale.float().repeat_interleave(16, dim=1) * s2


def _bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from minite.cli import main

    hf = tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"), seed=3)
    out = tmp_path_factory.mktemp("exp") / "nvfp4"
    assert main(["convert", "export-nvfp4", "--hf", str(hf), "--out", str(out)]) == 0
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return hf, out, tensors


def test_export_is_lossless_against_the_learner_quantisation(exported):
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf, qkv_rows
    from minite.ops import quantize_weight

    hf, _out, t = exported
    cfg = json.loads((hf / "config.json").read_text())
    mg = dict(megatron_view_of_hf(_HFReader(hf), cfg))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        ref = quantize_weight(mg[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"], _recipe()).dequantize()
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = torch.cat([torch.arange(r0, r0 + n) for nm, _g, r0, n in qkv_rows(cfg) if nm == name])
            assert _bits_equal(_modelopt_dequant(t, f"{p}self_attn.{name}"), ref[rows]), name
        ref = quantize_weight(mg[f"decoder.layers.{layer}.self_attention.linear_proj.weight"], _recipe()).dequantize()
        assert _bits_equal(_modelopt_dequant(t, f"{p}self_attn.o_proj"), ref)
        fc1, fc2 = mg[f"decoder.layers.{layer}.mlp.experts.fc1_weight"], mg[f"decoder.layers.{layer}.mlp.experts.fc2_weight"]
        f = fc1.shape[1] // 2
        for e in range(fc1.shape[0]):
            ref1 = quantize_weight(fc1[e], _recipe()).dequantize()
            assert _bits_equal(_modelopt_dequant(t, f"{p}mlp.experts.{e}.gate_proj"), ref1[:f])
            assert _bits_equal(_modelopt_dequant(t, f"{p}mlp.experts.{e}.up_proj"), ref1[f:])
            ref2 = quantize_weight(fc2[e], _recipe()).dequantize()
            assert _bits_equal(_modelopt_dequant(t, f"{p}mlp.experts.{e}.down_proj"), ref2)


def test_export_layout_and_unquantised_tensors(exported):
    hf, out, t = exported
    src = load_file(str(next(hf.glob("*.safetensors"))))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.1.self_attn.q_norm.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert torch.equal(t[name], src[name]), name
    assert t["model.layers.0.self_attn.q_proj.input_scale"].dtype == torch.float32
    assert not any(k.endswith("gate_up_proj") for k in t)
    q = json.loads((out / "hf_quant_config.json").read_text())
    assert q["quantization"]["quant_algo"] == "NVFP4" and q["quantization"]["group_size"] == 16
    assert "lm_head" in q["quantization"]["exclude_modules"]
    assert q["minite"]["activation"]["scale_scope"] == "row"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(t)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_export_from_megatron_equals_export_from_hf(exported, tmp_path):
    from minite.convert.export_nvfp4 import export_nvfp4
    from minite.convert.hf_megatron import hf_to_megatron

    hf, _out, t = exported
    mg = hf_to_megatron(hf, tmp_path / "mg", ep=2, progress=False)
    out = export_nvfp4(megatron_dir=mg, out_dir=tmp_path / "exp")
    t2 = {}
    for f in sorted(out.glob("*.safetensors")):
        t2.update(load_file(str(f)))
    assert set(t2) == set(t)
    for k in t:
        assert torch.equal(t2[k].reshape(-1).view(torch.uint8), t[k].reshape(-1).view(torch.uint8)), k


def test_export_errors_are_named(tmp_path):
    from minite.convert.export_nvfp4 import ExportError, export_nvfp4, pack_megatron_weights

    with pytest.raises(ExportError, match="no config.json"):
        export_nvfp4(hf_dir=tmp_path, out_dir=tmp_path / "o")
    with pytest.raises(ExportError, match="exactly one"):
        export_nvfp4(out_dir=tmp_path / "o")
    with pytest.raises(ExportError, match="unknown learner tensor"):
        list(pack_megatron_weights([("decoder.layers.0.mystery.weight", torch.zeros(16, 16))], {}, _recipe()))
