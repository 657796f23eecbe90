"""SGLang's own layers running the minite_nvfp4 plugin equal the learner's layers, bit for bit (CPU, gloo, world 1).

Each test builds a real SGLang layer (QKVParallelLinear, RowParallelLinear, FusedMoE) with quantization config
minite_nvfp4, fills it through SGLang's own weight loaders with the tensors `minite convert export-nvfp4` writes
(`pack_megatron_weights`), runs it, and compares with the learner on the same inputs and weights:
- linears: minite.ops.nvfp4_linear (the function NVFP4Column/RowParallelLinear call) on the Megatron weight
  (fused QKV in Megatron's interleaved layout; SGLang's [q; k; v] output columns are a permutation of it);
- experts: megatron_patches' GroupedExperts between Megatron's own moe_utils.permute and unpermute.
Exact comparison (atol=0, rtol=0): both sides run the same op functions on the same NVFP4 values.
"""
from __future__ import annotations

import pytest
import torch

from tests.rollout.sglang.conftest import free_port, sglang_skip_reason, tiny_hf_checkpoint

_REASON = sglang_skip_reason()
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

H, HEADS, GROUPS, D, E, F, TOPK = 64, 4, 2, 16, 4, 32, 2
HF_CFG = {"num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": D, "hidden_size": H,
          "num_hidden_layers": 1}


@pytest.fixture(scope="module")
def sgl_world(tmp_path_factory):
    """SGLang's process context and a gloo world of size 1 (what its scheduler sets up before building a model)."""
    from minite.rollout.sglang.plugin import register

    register()
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.distributed.parallel_state import model_parallel_is_initialized
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    model_dir = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"))
    args = ServerArgs(model_path=str(model_dir), device="cpu", attention_backend="torch_native",
                      disable_cuda_graph=True, sampling_backend="pytorch", skip_tokenizer_init=True)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    if not model_parallel_is_initialized():
        init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel()
    from minite.rollout.sglang.methods import MiniteNVFP4Config

    return MiniteNVFP4Config()


def _weight(n, k, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    w[0, :16] *= 40  # one outlier block: global scale set by it, other blocks small
    return w.to(torch.bfloat16)


def _inputs(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows of very different magnitude
    x[1] = 0  # an all-zero token
    return x.to(torch.bfloat16)


def _packed(name, w):
    from minite.convert.export_nvfp4 import pack_megatron_weights

    return dict(pack_megatron_weights([(name, w)], HF_CFG, _recipe(), input_scale=1.0))


def _recipe():
    from minite.nvfp4 import NVFP4Recipe

    return NVFP4Recipe()


def _learner_linear(x, w):
    from minite.ops import nvfp4_linear

    with torch.no_grad():
        return nvfp4_linear(x, w, _recipe(), backend="auto")


def test_qkv_parallel_linear_matches_learner(sgl_world):
    from sglang.srt.layers.linear import QKVParallelLinear

    from minite.convert.export_nvfp4 import qkv_rows

    layer = QKVParallelLinear(H, D, HEADS, GROUPS, bias=False, quant_config=sgl_world,
                              prefix="model.layers.0.self_attn.qkv_proj")
    w = _weight((HEADS + 2 * GROUPS) * D, H, seed=1)  # Megatron's fused, interleaved QKV weight
    tensors = _packed("decoder.layers.0.self_attention.linear_qkv.weight", w)
    params = dict(layer.named_parameters())
    for shard, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            p = params[suffix]
            p.weight_loader(p, tensors[f"model.layers.0.self_attn.{hf}.{suffix}"], shard)
    layer.quant_method.process_weights_after_loading(layer)
    x = _inputs(7, H, seed=2)
    with torch.no_grad():
        y_sgl, _ = layer(x)
    # SGLang's columns are [q; k; v], each group-major; the learner's are Megatron's interleaved order
    rows = {"q_proj": [], "k_proj": [], "v_proj": []}
    for name, _g, r0, n in qkv_rows(HF_CFG):
        rows[name].append(torch.arange(r0, r0 + n))
    perm = torch.cat([torch.cat(rows[n]) for n in ("q_proj", "k_proj", "v_proj")])
    y_ref = _learner_linear(x, w)[:, perm]
    assert y_sgl.dtype == y_ref.dtype == torch.bfloat16 and y_ref.abs().sum() > 0
    torch.testing.assert_close(y_sgl, y_ref, atol=0, rtol=0)


def test_row_parallel_linear_matches_learner(sgl_world):
    from sglang.srt.layers.linear import RowParallelLinear

    layer = RowParallelLinear(HEADS * D, H, bias=False, quant_config=sgl_world,
                              prefix="model.layers.0.self_attn.o_proj")
    w = _weight(H, HEADS * D, seed=3)
    tensors = _packed("decoder.layers.0.self_attention.linear_proj.weight", w)
    params = dict(layer.named_parameters())
    for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        p = params[suffix]
        p.weight_loader(p, tensors[f"model.layers.0.self_attn.o_proj.{suffix}"])
    x = _inputs(5, HEADS * D, seed=4)
    with torch.no_grad():
        y_sgl, _ = layer(x)
    torch.testing.assert_close(y_sgl, _learner_linear(x, w), atol=0, rtol=0)


def _load_fused_moe(layer, fc1, fc2):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    tensors = {}
    tensors.update(_packed("decoder.layers.0.mlp.experts.fc1_weight", fc1))
    tensors.update(_packed("decoder.layers.0.mlp.experts.fc2_weight", fc2))
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=E)
    params = dict(layer.named_parameters(prefix="model.layers.0.mlp.experts"))
    loaded = 0
    for name, t in tensors.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            pname = name.replace(weight_name, param_name)
            p = params[pname]
            p.weight_loader(p, t, pname, shard_id=shard_id, expert_id=expert_id)
            loaded += 1
            break
    assert loaded == len(tensors)


def _learner_experts(x, fc1, fc2, topk_w, topk_ids):
    """Megatron's permute -> GroupedExperts (NVFP4) -> unpermute, as the learner's MoELayer runs them."""
    import torch.nn.functional as Fn
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite.megatron_patches.nvfp4_layers import GroupedExperts, NVFP4Context

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, num_moe_experts=E,
                            moe_ffn_hidden_size=F, ffn_hidden_size=F, gated_linear_unit=True, activation_func=Fn.silu,
                            add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True,
                            use_cpu_initialization=True, perform_initialization=False)
    experts = GroupedExperts(E, cfg, nvfp4=NVFP4Context(recipe=_recipe()))
    with torch.no_grad():
        experts.fc1_weight.copy_(fc1)
        experts.fc2_weight.copy_(fc2)
        routing = torch.zeros(x.shape[0], E, dtype=torch.bool).scatter_(1, topk_ids.long(), True)
        probs = torch.zeros(x.shape[0], E, dtype=torch.float32).scatter_(1, topk_ids.long(), topk_w)
        px, pprobs, sorted_idx = permute(x, routing, probs=probs)
        out, _ = experts(px, routing.sum(0), pprobs)
        return unpermute(out, sorted_idx, restore_shape=x.shape, routing_map=routing)


def test_fused_moe_matches_learner(sgl_world):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    layer = FusedMoE(num_experts=E, top_k=TOPK, hidden_size=H, intermediate_size=F, layer_id=0,
                     quant_config=sgl_world, prefix="model.layers.0.mlp.experts")
    fc1 = torch.stack([_weight(2 * F, H, seed=10 + e) for e in range(E)])
    fc2 = torch.stack([_weight(H, F, seed=20 + e) for e in range(E)])
    _load_fused_moe(layer, fc1, fc2)
    layer.quant_method.process_weights_after_loading(layer)
    x = _inputs(9, H, seed=5)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(9, E, generator=g)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    topk_w = topk_w / topk_w.sum(-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int32)
    topk_ids[2] = torch.tensor([3, 0], dtype=torch.int32)  # ids not sorted: the combine order must not care
    with torch.no_grad():
        y_sgl = layer(x, StandardTopKOutput(topk_weights=topk_w, topk_ids=topk_ids, router_logits=logits))
    y_ref = _learner_experts(x, fc1, fc2, topk_w, topk_ids)
    assert y_sgl.dtype == y_ref.dtype == torch.bfloat16 and y_ref.abs().sum() > 0
    torch.testing.assert_close(y_sgl, y_ref, atol=0, rtol=0)
