"""The learner's GPU paths on the H200: grouped NVFP4 quantisation at real expert shapes (bitwise vs the reference),
the segmented wgrad GEMM (tensor-core bound), BF16 experts on torch._grouped_mm and attention on torch SDPA (both vs
the upstream-style loops they replace), and a small NVFP4 learner step on the kernels vs the reference backend."""
import pytest
import torch

import minite.kernels  # noqa: F401  registers the Triton kernels that backend="triton" below asks for
from minite.nvfp4 import (gemm_reference, quantize_column_segments, quantize_reference, quantize_stack,
                          segmented_gemm)
from tests.tolerances import TOLERANCES

pytestmark = pytest.mark.gpu
HIDDEN, FFN2 = 2048, 1536


def _routed_counts(rows, experts, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(experts, generator=g) ** 3
    w[::17] = 0  # some experts see no token
    counts = torch.floor(w / w.sum() * rows).long()
    counts[0] += rows - counts.sum()
    return counts.tolist()


def test_expert_stack_bitwise_real_shape():
    torch.manual_seed(0)
    w = (torch.randn(16, FFN2, HIDDEN, device="cuda") * torch.logspace(-3, 1, 16, device="cuda")[:, None, None])
    w = w.bfloat16()
    st = quantize_stack(w, values=True, backend="triton")
    for e in range(16):
        ref = quantize_reference(w[e], block=(16, 16), scale_scope="tensor", rounding="nearest", seed=None, rht=False)
        assert st[e].equal(ref)
        assert torch.equal(st.values[e], ref.block_values(torch.float16))
        assert st.t()[e].equal(ref.t())


def test_wgrad_segments_bitwise_and_segmented_gemm_bound():
    torch.manual_seed(1)
    counts = _routed_counts(8192, 128, 0)
    widths = [c + (-c) % 16 for c in counts]
    x = (torch.randn(sum(widths), HIDDEN, device="cuda") * 2).bfloat16()
    dy = (torch.randn(sum(widths), 768, device="cuda") * 1e-3).bfloat16()
    seeds = list(range(100, 228))
    a = quantize_column_segments(dy.t(), widths, rounding="stochastic", seeds=seeds, rht=True, values=True,
                                 backend="triton")
    b = quantize_column_segments(x.t(), widths, rht=True, values=True, backend="triton")
    a_ref = quantize_column_segments(dy.t(), widths, rounding="stochastic", seeds=seeds, rht=True,
                                     backend="reference")
    b_ref = quantize_column_segments(x.t(), widths, rht=True, backend="reference")
    for got, ref in ((a, a_ref), (b, b_ref)):
        assert torch.equal(got.data, ref.data) and torch.equal(got.global_scale, ref.global_scale)
        assert torch.equal(got.amax, ref.amax)
        assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    out = segmented_gemm(a, b, backend="triton")
    atol = TOLERANCES["nvfp4_gemm_tensorcore_acc"][0]
    for e in [i for i, w in enumerate(widths) if w][:6]:
        sa, sb = a.segment(e), b.segment(e)
        bound = (sa.block_values(torch.float64).abs() @ sb.block_values(torch.float64).abs().t()) * \
            float(sa.amax) * float(sb.amax) / 2688.0 ** 2
        err = (out[e].double() - gemm_reference(sa, sb).double()).abs()
        assert torch.all(err <= atol * bound + TOLERANCES["fp32_subnormal_floor"][0])
    assert all(torch.count_nonzero(out[e]) == 0 for e, w in enumerate(widths) if not w)


def test_bf16_experts_grouped_mm_equals_loop():
    from minite.ops import grouped_linear_bf16
    torch.manual_seed(2)
    counts = _routed_counts(4096, 32, 1)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32, 384, 512, device="cuda") * 0.05).bfloat16().requires_grad_()
    y = grouped_linear_bf16(x, w, counts, strict=False)
    dy = torch.randn_like(y)
    y.backward(dy)
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    outs, s = [], 0
    for e, c in enumerate(counts):
        outs.append(xl[s:s + c] @ wl[e].t())
        s += c
    yl = torch.cat(outs)
    yl.backward(dy)
    rtol = TOLERANCES["bf16_grouped_mm_vs_loop"][1]
    for got, want in ((y, yl), (x.grad, xl.grad), (w.grad, wl.grad)):
        assert torch.linalg.norm(got.float() - want.float()) <= rtol * torch.linalg.norm(want.float())


def test_sdpa_attention_bf16_matches_unfused_and_is_taken_on_gpu():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from minite.config import load_config
    from minite.learner.model import init_parallel
    from minite.megatron_patches.qwen3_moe import FusedDotProductAttention, Qwen3MoeShape, transformer_config
    init_parallel(load_config(None, []))
    model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    shape = Qwen3MoeShape(vocab_size=16, hidden_size=2048, num_layers=1, num_attention_heads=32,
                          num_query_groups=4, head_dim=128, moe_ffn_hidden_size=16, num_experts=2, moe_router_topk=2)
    conf = transformer_config(shape, compute_dtype=torch.bfloat16)
    up = DotProductAttention(conf, 1, AttnMaskType.causal, "self").cuda()
    fused = FusedDotProductAttention(conf, 1, AttnMaskType.causal, "self").cuda()
    q, k, v = (torch.randn(1024, 3, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 4, 4))
    assert fused._sdpa_mode(q, k, None, None, None, None) == "causal"
    err = (fused(q, k, v, None).float() - up(q, k, v, None).float()).abs().max().item()
    assert err <= TOLERANCES["sdpa_vs_unfused_bf16"][0] * v.float().abs().max().item()
    # a decode step (one query over the cache, no mask): SDPA too, each group's query heads over the group's cache
    # in place, and no fork of Megatron's RNG tracker
    fused.eval(), up.eval()
    assert fused._sdpa_mode(q[-1:], k, None, AttnMaskType.no_mask, None, None) == "decode"
    one = fused(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    err = (one.float() - up(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask).float()).abs().max().item()
    assert err <= TOLERANCES["sdpa_vs_unfused_bf16"][0] * v.float().abs().max().item()


def test_nvfp4_learner_step_kernels_vs_reference_backend():
    """A 2-layer NVFP4 model on the GPU: kernels and reference backends quantise every operand identically and
    differ only by fp32 summation (which can flip later roundings), so loss and gradient norm agree closely."""
    from minite.config import load_config
    from minite.learner.learner import Learner
    sets = ["model.num_layers=2", "model.hidden_size=256", "model.vocab_size=512", "model.num_experts=8",
            "model.moe_router_topk=2", "model.moe_ffn_hidden_size=128", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.head_dim=64", "precision.mode=nvfp4"]
    tokens = torch.randint(1, 512, (2, 257), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for backend in ("auto", "reference"):
        learner = Learner(load_config(None, sets))
        learner.nvfp4.backend = backend
        out[backend] = [learner.train_step(tokens, lambda lp: (-lp.mean(), {})) for _ in range(2)]
        learner.close()
    rtol = TOLERANCES["nvfp4_learner_kernels_vs_reference"][1]
    for a, b in zip(out["auto"], out["reference"]):
        assert abs(a["loss"] - b["loss"]) <= rtol * abs(b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= rtol * abs(b["grad_norm"])


def test_adam_is_fused_on_cuda_and_resume_stays_exact():
    """On CUDA the learner's AdamW is torch's fused kernel, also after loading a state saved with another
    implementation's flags; 2 steps + snapshot (on the CPU) + 2 steps equal a fresh learner loading the snapshot
    (bitwise)."""
    from minite.config import load_config
    from minite.learner.learner import Learner
    sets = ["model.num_layers=1", "model.hidden_size=128", "model.vocab_size=256", "model.num_experts=4",
            "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64", "model.num_attention_heads=2",
            "model.num_query_groups=1", "model.head_dim=64", "precision.mode=nvfp4", "optim.lr=3e-3"]
    tokens = torch.randint(1, 256, (2, 65), generator=torch.Generator().manual_seed(0)).cuda()
    loss = lambda lp: (-lp.mean(), {})  # noqa: E731
    a = Learner(load_config(None, sets))
    groups = lambda l: [g for o in l.optimizer.chained_optimizers for g in o.optimizer.param_groups]  # noqa: E731
    assert all(g["fused"] is True and g["foreach"] is False for g in groups(a))
    for _ in range(2):
        a.train_step(tokens, loss)
    snap = a.state_dict()
    leaves = []
    torch.utils._pytree.tree_map(lambda t: leaves.append(t) if torch.is_tensor(t) else None, snap)
    assert leaves and all(t.device.type == "cpu" for t in leaves)  # a checkpoint's snapshot takes no GPU memory
    for o in snap["optimizer"]:
        for g in o["optimizer"]["param_groups"]:
            g.update(fused=None, foreach=None)
        for st in o["optimizer"]["state"].values():
            st["step"] = st["step"].cpu()
    after = [a.train_step(tokens, loss) for _ in range(2)]
    b = Learner(load_config(None, sets))
    b.load_state_dict(snap)
    assert all(g["fused"] is True for g in groups(b))
    assert [b.train_step(tokens, loss) for _ in range(2)] == after
    assert torch.equal(a.logprobs(tokens), b.logprobs(tokens))
    a.close()
    b.close()
