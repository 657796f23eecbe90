"""The SGLang plugin's view of FusedMoE weights (minite.rollout.sglang.plugin, no SGLang import needed): one
NVFP4Stack over the stacked ModelOpt tensors gives the same grouped GEMM as per-expert NVFP4Tensors, whether the
gate/up shards of an expert share one global scale or not."""
import torch

from minite.nvfp4 import grouped_gemm, quantize_reference
from minite.nvfp4.modelopt import expert_stack, weight_tensor


def _modelopt_experts(e, n, k, equal_shards):
    """data [E, N, K/2], scale [E, N, K/16], scale_2 and amax [E, 2] (gate and up halves) as ModelOpt stores them
    (the amax as our export adds it)."""
    g = torch.Generator().manual_seed(0)
    qs = [quantize_reference(torch.randn(n, k, generator=g), block=(1, 16), scale_scope="tensor",
                             rounding="nearest", seed=None, rht=False) for _ in range(e)]
    half = torch.tensor([1.0, 1.0 if equal_shards else 0.5])
    s2 = torch.stack([q.decode_scale().expand(2) * half for q in qs])
    amax = torch.stack([q.amax.expand(2) * half for q in qs])
    return torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]), s2, amax


def test_expert_stack_matches_per_expert_tensors():
    a = quantize_reference(torch.randn(12, 64), block=(1, 16), scale_scope="row", rounding="nearest", seed=None,
                           rht=False)
    counts = [5, 0, 7]
    for equal in (True, False):
        data, scale, s2, amax = _modelopt_experts(3, 32, 64, equal)
        st = expert_stack(data, scale, s2, amax)
        assert st.global_scale.shape == ((3,) if equal else (3, 32)) and st.amax.shape == st.global_scale.shape
        assert st.data.data_ptr() == data.data_ptr()  # a view, not a copy
        per_expert = [weight_tensor(data[i], scale[i], s2[i], amax=amax[i]) for i in range(3)]
        assert torch.equal(grouped_gemm(a, st, counts, backend="reference"),
                           grouped_gemm(a, per_expert, counts, backend="reference"))


def test_weight_tensor_uses_the_exported_amax_and_falls_back_to_scale_2_times_2688():
    q = quantize_reference(torch.randn(32, 64) * 3, block=(1, 16), scale_scope="tensor", rounding="nearest",
                           seed=None, rht=False)
    s2 = q.decode_scale().reshape(1)
    w = weight_tensor(q.data, q.scale, s2, amax=q.amax.reshape(1))
    assert torch.equal(w.amax, q.amax) and torch.equal(w.dequantize(), q.dequantize())
    foreign = weight_tensor(q.data, q.scale, s2, amax=torch.full((1,), float("nan")))  # no amax in the checkpoint
    assert torch.equal(foreign.amax, s2[0] * 2688.0)
