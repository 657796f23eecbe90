"""minite convert hf-to-megatron / megatron-to-hf, on a random tiny Qwen3-MoE saved by transformers.

What is checked, and how strictly:
- round trip HF -> Megatron -> HF for several (tp, ep, pp) layouts: every safetensors file byte-identical (so every
  tensor bitwise), the index's weight_map equal;
- the Megatron checkpoint loads into the learner's GPTModel with every parameter covered, and its logits equal the
  Hugging Face Qwen3MoeForCausalLM's within TOLERANCES["hf_vs_megatron_logits_bf16_vs_noise"];
- missing / extra / misshapen tensors and truncated files fail before anything is written, naming tensor and file;
- peak memory of a conversion stays under a hard address-space limit smaller than the model (tools/convert_memory.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minite.convert.hf_megatron import ConversionError, hf_to_megatron, megatron_to_hf
from tests.tolerances import TOLERANCES

REPO = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, intermediate_size=96,
            max_position_embeddings=64, rope_theta=10000.0, norm_topk_prob=True, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def _hub_style_config(path: Path) -> None:
    """Write config.json the way the Hub's Qwen3-30B-A3B spells it (num_experts, top-level rope_theta)."""
    cfg = json.loads(path.read_text())
    cfg.pop("num_local_experts", None)
    cfg.pop("rope_parameters", None)
    cfg.update({k: TINY[k] for k in ("num_experts", "rope_theta")})
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A random BF16 Qwen3-MoE saved by transformers in small shards (per-expert tensors, as on the Hub)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms near 1, others large enough to spread router logits
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.08 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="100KB")
    _hub_style_config(out / "config.json")
    return out


def _safetensors_files(d: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(d.glob("*.safetensors"))}


@pytest.mark.parametrize("tp,ep,pp", [(1, 1, 1), (2, 4, 2), (4, 8, 4)])
def test_round_trip_is_bitwise(tiny_hf, tmp_path, tp, ep, pp):
    mg = hf_to_megatron(tiny_hf, tmp_path / "mg", tp=tp, ep=ep, pp=pp, progress=False)
    back = megatron_to_hf(mg, tmp_path / "hf", progress=False)
    a, b = _safetensors_files(tiny_hf), _safetensors_files(back)
    assert a.keys() == b.keys() and len(a) > 3
    assert all(a[k] == b[k] for k in a), "a round-trip safetensors file differs"
    idx = lambda d: json.loads((d / "model.safetensors.index.json").read_text())  # noqa: E731
    assert idx(tiny_hf)["weight_map"] == idx(back)["weight_map"]
    assert idx(back)["metadata"]["total_size"] == idx(tiny_hf)["metadata"]["total_size"]
    assert len(list(mg.glob("dense_*.safetensors"))) == tp * pp and len(list(mg.glob("experts_*"))) == ep * pp


def test_qkv_interleave_and_expert_layout(tiny_hf, tmp_path):
    """The Megatron tensors hold what the docstring says: [q_g; k_g; v_g] per group, fc1 = [gate; up] per expert."""
    from safetensors.torch import load_file

    mg = hf_to_megatron(tiny_hf, tmp_path / "mg", tp=2, ep=2, pp=1, progress=False)
    hf = {}
    for f in tiny_hf.glob("*.safetensors"):
        hf.update(load_file(f))
    d, qpg, gpr = TINY["head_dim"], TINY["num_attention_heads"] // TINY["num_key_value_heads"], 2
    qkv = load_file(mg / "dense_tp01_pp000.safetensors")["decoder.layers.3.self_attention.linear_qkv.weight"]
    g = 2 + 1  # rank 1's second group
    rows = qkv[(qpg + 2) * d: 2 * (qpg + 2) * d]
    assert torch.equal(rows[:qpg * d], hf["model.layers.3.self_attn.q_proj.weight"][g * qpg * d:(g + 1) * qpg * d])
    assert torch.equal(rows[qpg * d:(qpg + 1) * d], hf["model.layers.3.self_attn.k_proj.weight"][g * d:(g + 1) * d])
    assert torch.equal(rows[(qpg + 1) * d:], hf["model.layers.3.self_attn.v_proj.weight"][g * d:(g + 1) * d])
    assert qkv.shape[0] == gpr * (qpg + 2) * d
    fc1 = load_file(mg / "experts_pp000_ep001.safetensors")["decoder.layers.0.mlp.experts.fc1_weight"]
    f = TINY["moe_intermediate_size"]
    assert torch.equal(fc1[1, :f], hf["model.layers.0.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fc1[1, f:], hf["model.layers.0.mlp.experts.5.up_proj.weight"])


def _megatron_logits(hf_dir: Path, mg: Path, dtype: str, tokens: torch.Tensor, init: bool) -> torch.Tensor:
    from minite.config import load_config
    from minite.convert.hf_megatron import load_into_model
    from minite.learner.model import build_model

    cfg = load_config(None, [f"model.hf_config={hf_dir / 'config.json'}", "precision.mode=bf16",
                             f"precision.compute_dtype={dtype}", "model.max_position_embeddings=64"])
    model = build_model(cfg, strict=False, init_parallel_state=init).eval()
    names = load_into_model(model, mg)
    assert len(names) == len([k for k in model.state_dict() if "_extra_state" not in k])
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None).float()


def _hf_logits(hf_dir: Path, dtype: torch.dtype, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3MoeForCausalLM

    with torch.no_grad():
        return Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()(tokens).logits.float()


def test_logits_match_transformers(tiny_hf, tmp_path):
    """HF Qwen3MoeForCausalLM vs the learner's GPTModel loaded from the converted checkpoint, FP32 and BF16."""
    mg = hf_to_megatron(tiny_hf, tmp_path / "mg", progress=False)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    hf32, hf16 = _hf_logits(tiny_hf, torch.float32, tokens), _hf_logits(tiny_hf, torch.bfloat16, tokens)
    mg32 = _megatron_logits(tiny_hf, mg, "float32", tokens, init=True)
    mg16 = _megatron_logits(tiny_hf, mg, "bfloat16", tokens, init=False)
    scale = hf32.abs().max()
    atol32, _ = TOLERANCES["hf_vs_megatron_logits_fp32"]
    gap32 = (mg32 - hf32).abs().max()
    factor, _ = TOLERANCES["hf_vs_megatron_logits_bf16_vs_noise"]
    noise, gap16 = (hf16 - hf32).abs(), (mg16 - hf16).abs()
    print(f"max|logit| {scale:.4g}; fp32 gap {gap32:.3g}; bf16 gap max {gap16.max():.4g} mean {gap16.mean():.3g}; "
          f"HF bf16 noise max {noise.max():.4g} mean {noise.mean():.3g}")
    assert gap32 <= atol32 * scale, f"fp32 logits gap {gap32:.3g} > {atol32:.3g} * max|logit| {scale:.4g}"
    assert gap16.max() <= factor * noise.max(), f"bf16 gap {gap16.max():.4g} > {factor} x HF's bf16 noise"
    assert gap16.mean() <= factor * noise.mean(), f"bf16 mean gap {gap16.mean():.4g} > {factor} x HF's bf16 noise"


# ------------------------------------------------------------------------------------------------ failures
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(d: Path, fn) -> str:
    """Apply fn to the tensors of the shard holding layer 1's q_proj; returns that shard's name."""
    from safetensors.torch import load_file, save_file

    name = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.1.self_attn.q_proj.weight"]
    tensors = load_file(d / name)
    fn(tensors)
    save_file(tensors, d / name, metadata={"format": "pt"})
    return name


def test_missing_tensor_names_tensor_and_file(tiny_hf, tmp_path):
    d = _copy(tiny_hf, tmp_path / "hf")
    shard = _rewrite_shard(d, lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"))
    with pytest.raises(ConversionError, match=rf"model\.layers\.1\.self_attn\.q_proj\.weight.*{shard}"):
        hf_to_megatron(d, tmp_path / "mg", progress=False)
    assert not (tmp_path / "mg").exists()


def test_extra_and_misshapen_tensors_are_named(tiny_hf, tmp_path):
    d = _copy(tiny_hf, tmp_path / "hf")

    def edit(t):
        t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:-1].clone()
        t["model.layers.1.mlp.shared_expert.weight"] = torch.zeros(2, 2)

    shard = _rewrite_shard(d, edit)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **json.loads((tiny_hf / "model.safetensors.index.json").read_text())["weight_map"],
        "model.layers.1.mlp.shared_expert.weight": shard}}))
    with pytest.raises(ConversionError) as err:
        hf_to_megatron(d, tmp_path / "mg", progress=False)
    msg = str(err.value)
    assert f"tensor 'model.layers.1.self_attn.q_proj.weight' in {d / shard}: shape [127, 64]" in msg
    assert f"extra tensor 'model.layers.1.mlp.shared_expert.weight' in {d / shard}" in msg


def test_truncated_file_is_named(tiny_hf, tmp_path):
    d = _copy(tiny_hf, tmp_path / "hf")
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ConversionError, match=rf"{shard}: truncated file: tensor '"):
        hf_to_megatron(d, tmp_path / "mg", progress=False)
    mg = hf_to_megatron(tiny_hf, tmp_path / "mg2", ep=2, progress=False)
    part = mg / "experts_pp000_ep001.safetensors"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(ConversionError, match=rf"{part}: truncated file: tensor 'decoder\.layers\.3\.mlp"):
        megatron_to_hf(mg, tmp_path / "back", progress=False)


def test_cli_round_trip(tiny_hf, tmp_path):
    """The fixed interface, through the `minite` entry point."""
    from minite.cli import main

    assert main(["convert", "hf-to-megatron", "--hf", str(tiny_hf), "--out", str(tmp_path / "mg"), "--ep", "2",
                 "--no-progress"]) == 0
    assert main(["convert", "megatron-to-hf", "--megatron", str(tmp_path / "mg"), "--out", str(tmp_path / "hf"),
                 "--no-progress"]) == 0
    assert _safetensors_files(tiny_hf) == _safetensors_files(tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf", str(tiny_hf), "--out", str(tmp_path / "mg"),
                 "--no-progress"]) == 2  # refuses to overwrite: a user error


@pytest.mark.slow
def test_peak_memory_below_a_limit_smaller_than_the_model(tmp_path):
    """tools/convert_memory.py: a 320 MiB random model converted both ways under a 160 MiB address-space budget.

    Peak RSS growth measured 19-39 MiB; the budget is address space (mappings, thread arenas), whose headroom varied
    between runs: a 96 MiB budget failed once in a full-suite CI run, so the budget keeps 4x the measured peak while
    staying half the model's size."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "convert_memory.py"), "--model-mib", "320",
                          "--limit-mib", "160", "--dir", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=150, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["model_bytes"] > res["limit_bytes"]
    for direction in ("hf_to_megatron", "megatron_to_hf"):
        assert res[direction]["peak_rss_growth_bytes"] < res["limit_bytes"], res
    assert res["megatron_to_hf"]["bitwise"] is True


def test_learner_starts_from_a_converted_checkpoint(tiny_hf, tmp_path):
    """model.init_from: the learner's initial weights are the converted ones (and training then moves them)."""
    from minite.config import load_config
    from minite.convert.hf_megatron import load_into_model
    from minite.learner.learner import Learner
    from minite.learner.model import build_model

    mg = hf_to_megatron(tiny_hf, tmp_path / "mg", progress=False)
    overrides = [f"model.hf_config={tiny_hf / 'config.json'}", f"model.init_from={mg}", "precision.mode=bf16",
                 "model.max_position_embeddings=64"]
    learner = Learner(load_config(None, overrides))
    expect = build_model(load_config(None, overrides[:1] + overrides[2:]), strict=False, init_parallel_state=False)
    load_into_model(expect, mg)
    got = dict(learner.model.state_dict())
    for name, t in expect.state_dict().items():
        if "_extra_state" not in name:
            assert torch.equal(got[name], t), name


def test_transformers5_config_spelling(tiny_hf, tmp_path):
    """transformers 5 writes num_local_experts and rope_parameters.rope_theta; both are read."""
    from minite.models.qwen3_moe import Qwen3MoeShape

    cfg = json.loads((tiny_hf / "config.json").read_text())
    cfg["num_local_experts"] = cfg.pop("num_experts")
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    shape = Qwen3MoeShape.from_any(cfg)
    assert shape.num_experts == TINY["num_experts"] and shape.rope_theta == TINY["rope_theta"]
