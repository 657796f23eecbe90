"""megatron_patches.moe_dispatch: the embedded engine's MoE dispatcher for EP = 1 gives Megatron's alltoall
dispatcher's rows and outputs bit for bit (BF16 and NVFP4, default and strict, experts that receive no token), with no
data-dependent op and no host read of a tensor; the engine's tokens and log-probs do not change with it; the grouped
GEMMs take the counts as a tensor."""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.config import load_config

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64", "model.num_experts=8",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.max_position_embeddings=32", "rl.seed=5"]
aten = torch.ops.aten
SYNCING = {aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default, aten.item.default,
           aten.equal.default, aten.bincount.default, aten.unique_consecutive.default, aten._unique2.default}


class _Syncs(TorchDispatchMode):
    """Ops that synchronise with the host on a GPU (data-dependent sizes, scalar reads)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _model(precision, strict):
    from minite.learner.model import build_model
    return build_model(load_config(None, TINY + [f"precision.mode={precision}"]), strict=strict).eval()


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("strict", [False, True])
def test_local_dispatch_is_megatrons_bit_for_bit(precision, strict):
    from minite.megatron_patches.moe_dispatch import (LocalTokenDispatcher, restore_upstream_dispatch,
                                                      use_local_dispatch)
    model = _model(precision, strict)
    layer = _moe_layers(model)[0]
    dev = next(model.parameters()).device  # build_model puts the model on the GPU when there is one
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(7, 3, 64, generator=g), torch.randn(1, 2, 64, generator=g),  # decode-sized: idle experts
             torch.randn(5, 1, 64, generator=g) * 0 + torch.randn(1, 1, 64, generator=g)]  # every token alike
    with torch.no_grad():
        ref = [layer(x.to(dev, torch.bfloat16))[0] for x in cases]
        assert use_local_dispatch(model) == 2 and use_local_dispatch(model) == 2
        assert isinstance(layer.token_dispatcher, LocalTokenDispatcher)
        with _Syncs() as syncs:
            got = [layer(x.to(dev, torch.bfloat16))[0] for x in cases]
        assert restore_upstream_dispatch(model) == 2
        again = [layer(x.to(dev, torch.bfloat16))[0] for x in cases]
    for r, o, a in zip(ref, got, again):
        assert o.dtype == r.dtype and torch.equal(o, r) and torch.equal(a, r)
    # no data-dependent op; on the CPU the NVFP4 quantiser's own NaN check reads a scalar (not on a GPU), and the
    # per-expert loops read the counts with tolist (no op of its own on the CPU; the GPU's GEMMs take the tensor)
    assert not [op for op in syncs.ops if "item" not in op and "local_scalar" not in op]
    assert precision == "nvfp4" or not syncs.ops


@pytest.mark.parametrize("one_launch", [False, True])
def test_local_rows_match_megatrons_permutation(one_launch, monkeypatch):
    """The rows (token per row, router prob per row, tokens per expert) are those of moe_utils.permute, from the
    torch ops and from the one-launch kernel (minite.kernels.moe_rows; interpreted on the CPU)."""
    from megatron.core.transformer.moe.moe_utils import permute

    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from minite.kernels import moe_rows
    from minite.megatron_patches.moe_dispatch import LocalTokenDispatcher
    monkeypatch.setattr(moe_dispatch, "_rows_in_one_launch", lambda m, p: one_launch and moe_rows.applies(m, p))
    layer = _moe_layers(_model("bf16", False))[0]
    local = LocalTokenDispatcher(layer.token_dispatcher)
    g = torch.Generator().manual_seed(1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled on a GPU, interpreted on the CPU
    for tokens in (1, 5, 33, 70):
        logits = torch.randn(tokens, 8, generator=g)
        idx = logits.topk(2, dim=1).indices
        routing_map = torch.zeros(tokens, 8, dtype=torch.bool).scatter(1, idx, True).to(dev)
        probs = torch.zeros(tokens, 8).scatter(1, idx, torch.rand(tokens, 2, generator=g)).to(dev)
        hidden = torch.randn(tokens, 1, 16, generator=g).to(dev)
        with _Syncs() as syncs:
            rows, row_probs = local.dispatch_preprocess(hidden, routing_map, probs)
            _, counts, _ = local.dispatch_postprocess(rows, row_probs)
        assert syncs.ops == []
        want_rows, want_probs, want_index = permute(hidden.view(tokens, 16), routing_map, probs=probs,
                                                    num_out_tokens=tokens * 2)
        assert torch.equal(rows, want_rows) and torch.equal(row_probs, want_probs)
        assert torch.equal(local.row_token, want_index) and torch.equal(counts, routing_map.sum(0))


@pytest.mark.parametrize("tokens,experts,topk,short", [(64, 128, 8, False), (256, 128, 8, False), (37, 60, 4, False),
                                                       (1, 128, 8, False), (20, 128, 8, True)])
def test_one_launch_rows_equal_the_torch_ops(tokens, experts, topk, short):
    """minite.kernels.moe_rows against the dispatcher's torch ops at decode sizes up to MAX_TOKENS (a non-power-of-two
    expert count, a single token; short: map rows with fewer than k entries, whose missing rows get token 0 and
    probs[0, 0] as the torch ops leave them): the same row tokens, probs and counts (interpreted on the CPU,
    compiled on a GPU)."""
    from minite.kernels.moe_rows import applies, moe_rows
    from minite.megatron_patches.moe_dispatch import LocalTokenDispatcher

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens)
    idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True).to(dev)
    probs = torch.zeros(tokens, experts).scatter(1, idx, torch.rand(tokens, topk, generator=g)).to(dev)
    if short:
        routing_map[3, idx[3, :2]] = False
        routing_map[11, idx[11, 0]] = False
        probs[0, 0] = 0.25  # what the missing rows repeat
    assert applies(routing_map, probs)
    from minite.kernels.moe_rows import MAX_TOKENS  # a prefill's map: the torch ops
    assert not applies(torch.zeros(MAX_TOKENS + 1, 4, dtype=torch.bool), torch.zeros(MAX_TOKENS + 1, 4))
    row_token, row_probs, counts = moe_rows(routing_map, probs, tokens * topk)

    class _Cfg:
        moe_router_topk = topk

    class _Upstream:  # the attributes LocalTokenDispatcher copies
        config, num_local_experts, local_expert_indices = _Cfg(), experts, list(range(experts))

    torch_ops = LocalTokenDispatcher(_Upstream())  # on CPU tensors: the torch ops (the kernel takes CUDA ones)
    hidden = torch.randn(tokens, 1, 8, generator=g)
    _, want_probs = torch_ops.dispatch_preprocess(hidden, routing_map.cpu(), probs.cpu())
    assert torch.equal(row_token.cpu(), torch_ops.row_token) and torch.equal(row_probs.cpu(), want_probs)
    assert torch.equal(counts.cpu(), torch_ops.tokens_per_expert)


@pytest.mark.parametrize("tokens,experts,topk,dtype,scale", [(64, 128, 8, torch.float32, None), (1, 128, 8,
                         torch.float32, None), (300, 60, 4, torch.bfloat16, 2.5), (17, 128, 8, torch.float32, 1.0)])
def test_router_dense_outputs_in_one_launch(tokens, experts, topk, dtype, scale, monkeypatch):
    """`routing_in_one_launch` (the one-launch dense probs and map, interpreted on the CPU, compiled on a GPU) gives
    upstream's topk_routing_with_score_function tensors bit for bit: Qwen3-MoE's router (top-k, then a softmax over
    the k), fp32 and bf16 router logits, a scaling factor, 60 experts, a NaN logit; the cases it does not take
    (softmax before the top-k, a gradient to record) are upstream's call. The GPU test that put `routing_dense` in
    fused.PROVEN: the kernel runs here whether proven or not (and routing_topk, which would replace it, does not)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function as upstream

    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from minite.strict import fused
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fused, "PROVEN", (fused.PROVEN | {moe_dispatch.ROUTING_KERNEL}) - {moe_dispatch.TOPK_KERNEL})
    if dev == "cpu":  # the interpreter runs the kernel on CPU tensors
        monkeypatch.setattr(moe_dispatch, "_dense_in_one_launch", lambda logits: True)
    from minite.kernels import moe_rows
    ran = []
    kernel = moe_rows.routing_dense
    monkeypatch.setattr(moe_rows, "routing_dense", lambda *a: ran.append(1) or kernel(*a))
    routing = moe_dispatch.routing_in_one_launch(upstream)
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=g).to(dtype).to(dev)
    logits[0, 3] = float("nan")
    for pre in (False, True):
        got = routing(logits, topk, use_pre_softmax=pre, scaling_factor=scale)
        assert len(ran) == 1  # the kernel made the first pair (what the gate proves), upstream the second
        want = upstream(logits, topk, use_pre_softmax=pre, scaling_factor=scale)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    if dev == "cuda":  # a gradient to record: upstream's scatter, whose backward the probs need
        probs, _ = routing(logits.float().requires_grad_(), topk)
        assert probs.grad_fn is not None and "Scatter" in type(probs.grad_fn).__name__


@pytest.mark.parametrize("tokens,experts,topk,dtype,scale", [(64, 128, 8, torch.float32, None), (1, 128, 8,
                         torch.float32, None), (300, 60, 4, torch.bfloat16, 2.5), (17, 128, 8, torch.float32, 1.0)])
def test_router_topk_softmax_in_the_same_launch(tokens, experts, topk, dtype, scale, monkeypatch):
    """With "routing_topk" proven the wrapper makes upstream's tensors in one launch from the logits
    (`moe_rows.routing_topk`, interpreted on the CPU, compiled on a GPU, where it put the name in fused.PROVEN): the
    same map (random logits, no ties), probs within "router_softmax_fused" (fp32; "..._bf16" for bf16 logits), a NaN
    logit's row NaN as upstream's; equal logits: the lowest experts, -inf logits ranked as upstream ranks them."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function as upstream

    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from minite.kernels import moe_rows
    from minite.strict import fused
    from tests.tolerances import TOLERANCES
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {moe_dispatch.ROUTING_KERNEL, moe_dispatch.TOPK_KERNEL})
    if dev == "cpu":  # the interpreter runs the kernel on CPU tensors
        monkeypatch.setattr(moe_dispatch, "_dense_in_one_launch", lambda logits: True)
    ran, kernel = [], moe_rows.routing_topk
    monkeypatch.setattr(moe_rows, "routing_topk", lambda *a: ran.append(1) or kernel(*a))
    routing = moe_dispatch.routing_in_one_launch(upstream)
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=g) * 2
    if dtype == torch.bfloat16:  # distinct in a row (bf16 rounding makes ties): multiples of 1/8, exact in bf16
        logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]) / 8 - experts / 16
    logits = logits.to(dtype).to(dev)
    logits[0, 3] = float("nan")
    if tokens > 1:  # a peaked row: gaps of 10-80 below its top (the GPU's exp errs most there)
        logits[1, :topk] = torch.tensor([0.0, -10.0, -20.0, -40.0, -60.0, -70.0, -75.0, -80.0][:topk], dtype=dtype)
        logits[1, topk:] = -200.0
    (probs, rmap), (want, want_map) = routing(logits, topk, scaling_factor=scale), \
        upstream(logits, topk, scaling_factor=scale)
    assert ran == [1] and probs.dtype == want.dtype and rmap.dtype == want_map.dtype == torch.bool
    assert torch.equal(rmap, want_map) and torch.equal(probs.isnan(), want.isnan()) and bool(probs[0].isnan().any())
    atol, rtol = TOLERANCES["router_softmax_fused" if dtype == torch.float32 else "router_softmax_fused_bf16"]
    fin = ~want.isnan()
    assert bool(((probs[fin].double() - want[fin].double()).abs() <= atol + rtol * want[fin].double().abs()).all())
    ties = torch.zeros(3, 8, device=dev)
    ties[1], ties[1, 5], ties[2, 6] = float("-inf"), 1.0, float("inf")
    p, m = moe_rows.routing_topk(ties, 3)
    assert m.int().tolist()[:2] == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1, 0, 0]]  # the lowest of equals
    third = (p[0, :3].cpu().double() - 1 / 3).abs()  # a GPU's division: within the tolerance
    assert bool((third <= TOLERANCES["router_softmax_fused"][0] + TOLERANCES["router_softmax_fused"][1] / 3).all())
    assert p[1].tolist() == [0.0] * 5 + [1.0, 0.0, 0.0]
    assert bool(p[2, m[2]].isnan().all()) and bool(m[2, 6])  # +inf: upstream's softmax gives NaN too
    with pytest.raises(ValueError, match="1 <= topk <= E"):
        moe_rows.routing_topk(ties, 9)
    with pytest.raises(ValueError, match="fp64: upstream's"):
        moe_rows.routing_topk(ties.double(), 2)
    ran.clear()
    routing(logits.double(), topk, scaling_factor=scale)  # fp64 logits: upstream's ops
    assert ran == []


@pytest.mark.parametrize("tokens,hidden,experts", [(64, 2048, 128), (1, 2048, 128), (40, 256, 60)])
def test_router_logits_in_one_launch(tokens, hidden, experts, monkeypatch):
    """With "router_logits" proven the wrapper gives the router's fp32 logits from its bf16 input and weight in one
    launch (`moe_rows.router_logits`, interpreted on the CPU, compiled on a GPU, where its pass puts the name in
    fused.PROVEN): within "router_logits_fused" of the exact sum of the products, as upstream's fp32 GEMM is, a NaN
    input's row NaN as upstream's, zero rows zero; a token's logits bitwise the same at 1, 17 and `tokens` tokens; the
    calls it does not take (a gradient to record, a bias, a bf16 router, fp32 operands) are upstream's."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear as upstream

    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from minite.kernels import moe_rows
    from minite.megatron_patches import cpu as cpu_patches
    from minite.strict import fused
    from tests.tolerances import TOLERANCES
    cpu_patches._patch_te_general_gemm()  # 0.16.1 leaves it undefined without TE (the model builders define it)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {moe_dispatch.ROUTER_LOGITS_KERNEL})
    if dev == "cpu":  # the interpreter runs the kernel on CPU tensors
        monkeypatch.setattr(moe_dispatch, "_gating_in_one_launch", moe_dispatch._gating_applies)
    ran, kernel = [], moe_rows.router_logits
    monkeypatch.setattr(moe_rows, "router_logits", lambda *a: ran.append(1) or kernel(*a))
    gating = moe_dispatch.router_gating_in_one_launch(upstream)
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)  # equal values, NaN where NaN
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1, hidden, generator=g).bfloat16()
    if tokens > 1:
        x[-1, 0, :] = 0.0
    if tokens > 2:
        x[1, 0, 7] = float("nan")
        x[2, 0, :] *= 2.0 ** 40  # large, still finite: fp32 products and sums
    w = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).bfloat16()
    x, w = x.to(dev), w.to(dev)
    got = gating(x, w, None, torch.float32)
    assert ran == [1] and got.dtype == torch.float32 and got.shape == (tokens, 1, experts)
    want = upstream(x, w, None, torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and (tokens == 1 or bool(got[-1].eq(0).all()))
    fin = ~want.view(tokens, experts).isnan()
    xd, wd = x.view(tokens, hidden).double().cpu(), w.double().cpu()
    exact, size = xd.nan_to_num() @ wd.t(), xd.nan_to_num().abs() @ wd.abs().t()
    bound = TOLERANCES["router_logits_fused"][0] * hidden * size
    for logits in (got, want):  # the kernel and upstream's fp32 GEMM: the same bound
        err = (logits.view(tokens, experts).double().cpu() - exact).abs()
        assert bool((err[fin.cpu()] <= bound[fin.cpu()]).all())
    for n in sorted({1, min(17, tokens)}):
        assert same(gating(x[:n], w, None, torch.float32), got[:n])
    ran.clear()
    bias = torch.zeros(experts, dtype=torch.bfloat16, device=dev)
    for args in ((x, w, bias, torch.float32), (x, w, None, torch.bfloat16),
                 (x.float(), w.float(), None, torch.float32)):
        assert same(gating(*args), upstream(*args))
    trained = gating(x.clone().requires_grad_(), w, None, torch.float32)
    assert ran == [] and trained.grad_fn is not None


def test_router_wrapper_waits_for_its_gpu_test(monkeypatch):
    """Without 'routing_dense' in fused.PROVEN the wrapper is upstream's call with the same arguments; proven, it
    still leaves CPU tensors, a gradient to record and deterministic algorithms to upstream."""
    import types

    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from minite.strict import fused
    calls = []
    routing = moe_dispatch.routing_in_one_launch(lambda *a, **k: calls.append((a, k)) or "upstream")
    logits = torch.randn(3, 8)
    assert routing(logits, 2, scaling_factor=2.0) == "upstream"
    assert calls[0][1] == dict(use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=2.0,
                               score_function="softmax", expert_bias=None, fused=False, router_replay=None)
    gpu = types.SimpleNamespace(is_cuda=True, dim=lambda: 2, requires_grad=False)
    assert moe_dispatch.ROUTING_KERNEL in fused.PROVEN  # since its GPU test passed (2026-12-06)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {moe_dispatch.ROUTING_KERNEL})
    assert not moe_dispatch._dense_in_one_launch(gpu)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {moe_dispatch.ROUTING_KERNEL})
    assert moe_dispatch._dense_in_one_launch(gpu) and not moe_dispatch._dense_in_one_launch(logits)
    with torch.enable_grad():
        assert not moe_dispatch._dense_in_one_launch(types.SimpleNamespace(is_cuda=True, dim=lambda: 2,
                                                                           requires_grad=True))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not moe_dispatch._dense_in_one_launch(gpu)


def test_router_gating_wrapper_takes_only_proven_gpu_calls(monkeypatch):
    """Unproven, 'router_logits' leaves every router_gating_linear call to upstream with the same arguments; proven (as
    it is), it still leaves CPU tensors to upstream; the install wraps Megatron's router function once."""
    import minite.megatron_patches.moe_dispatch as moe_dispatch
    from megatron.core.transformer.moe import router
    from minite.strict import fused
    calls = []
    gating = moe_dispatch.router_gating_in_one_launch(lambda *a: calls.append(a) or "upstream")
    x, w = torch.randn(3, 1, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    assert moe_dispatch.ROUTER_LOGITS_KERNEL in fused.PROVEN  # since its GPU test passed (2026-12-07)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {moe_dispatch.ROUTER_LOGITS_KERNEL})
    assert gating(x, w, None, torch.float32) == "upstream" and calls[0] == (x, w, None, torch.float32)
    assert moe_dispatch._gating_applies(x, w, None, torch.float32)  # the kernel's call, but not proven
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {moe_dispatch.ROUTER_LOGITS_KERNEL})
    assert gating(x, w, None, torch.float32) == "upstream" and len(calls) == 2  # CPU tensors
    monkeypatch.setattr(router, "router_gating_linear", router.router_gating_linear)  # restored after the test
    monkeypatch.setattr(router, "topk_routing_with_score_function", router.topk_routing_with_score_function)
    moe_dispatch._install_routing_in_one_launch()
    wrapped = router.router_gating_linear
    moe_dispatch._install_routing_in_one_launch()
    assert router.router_gating_linear is wrapped and hasattr(wrapped, "upstream")
    assert not hasattr(wrapped.upstream, "upstream")


def test_engine_tokens_and_logprobs_do_not_change():
    from minite.learner.model import build_model
    from minite.rollout import SamplingParams
    from minite.rollout.embedded import EmbeddedEngine

    cfg = load_config(None, TINY + ["precision.mode=nvfp4"])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=5, n=2, seed=7)
    out = []
    for local in (False, True):
        engine = EmbeddedEngine(build_model(cfg, strict=False), local_moe_dispatch=local)
        assert engine.local_moe_layers == (2 if local else 0)
        out.append([(r.tokens, r.logprobs) for r in engine.generate(prompts, params)])
    assert out[0] == out[1]


def test_grouped_gemms_take_counts_as_a_tensor():
    """Counts as a tensor: the Triton kernels (interpreter on the CPU) read it as is when no backward needs host
    counts, with or without grad the result is the host list's; the BF16 per-expert loop reads it on the host."""
    from minite.nvfp4 import NVFP4Recipe
    from minite.ops import grouped_linear_bf16, nvfp4_grouped_linear
    from minite.ops.grouped import _counts
    counts = [5, 0, 11, 16]
    g = torch.Generator().manual_seed(2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the kernels on a GPU
    x, w = torch.randn(32, 64, generator=g).to(dev), torch.randn(4, 32, 64, generator=g).to(dev)
    t = torch.tensor(counts, device=dev)
    assert _counts(t, 4, 32, keep_tensor=True) is t and _counts(t, 4, 32) == counts
    with pytest.raises(ValueError, match="must have 4 entries"):
        _counts(t[:3], 4, 32, keep_tensor=True)
    with torch.no_grad():
        want = nvfp4_grouped_linear(x, w, counts, NVFP4Recipe(), seed=1, backend="triton")
        assert torch.equal(nvfp4_grouped_linear(x, w, t, NVFP4Recipe(), seed=1, backend="triton"), want)
    xg = x.clone().requires_grad_()
    y = nvfp4_grouped_linear(xg, w, t, NVFP4Recipe(), seed=1, backend="triton")
    y.sum().backward()
    assert torch.equal(y.detach(), want) and xg.grad is not None
    xb, wb = x.bfloat16(), w.bfloat16()
    for strict in (False, True):
        assert torch.equal(grouped_linear_bf16(xb, wb, t, strict=strict), grouped_linear_bf16(xb, wb, counts, strict=strict))


@pytest.mark.parametrize("precision,backend", [("bf16", "auto"), ("nvfp4", "auto"),
                                               pytest.param("nvfp4", "triton", marks=pytest.mark.slow)])
def test_learner_steps_with_local_dispatch_are_megatrons_bit_for_bit(precision, backend, monkeypatch):
    """The Learner dispatches locally at EP = 1: two train steps (two micro-batches each) give the losses, gradient
    norms and weights of a learner on Megatron's alltoall dispatcher, bit for bit (gradients through the rows'
    index_select and the combine's scatter_add are upstream's). backend="triton" runs the kernels' path (interpreted
    on a CPU): host counts read once per layer, values-only caches, the dgrad's transposed reads."""
    from minite.learner import learner as learner_mod
    from minite.megatron_patches.moe_dispatch import LocalTokenDispatcher
    cfg = load_config(None, TINY + [f"precision.mode={precision}"])
    tokens = torch.randint(1, 64, (4, 17), generator=torch.Generator().manual_seed(3))

    def loss_fn(logp):
        return -logp.mean(), {}

    runs = []
    steps = 1 if backend == "triton" else 2  # the interpreter is slow
    for local in (True, False):
        with monkeypatch.context() as mp:
            if not local:
                mp.setattr(learner_mod, "use_local_dispatch", lambda model: 0)
            learner = learner_mod.Learner(cfg)
        if learner.nvfp4 is not None:
            learner.nvfp4.backend = backend
        assert learner.local_moe_layers == (2 if local else 0)
        assert isinstance(_moe_layers(learner.model)[0].token_dispatcher, LocalTokenDispatcher) == local
        dev = next(learner.model.parameters()).device
        metrics = [learner.train_step(tokens.to(dev), loss_fn, micro_batches=2) for _ in range(steps)]
        runs.append((metrics, {n: p.detach().clone() for n, p in learner.model.named_parameters()}))
        learner.close()
    (m_local, w_local), (m_up, w_up) = runs
    assert m_local == m_up
    assert all(torch.equal(w_local[n], w_up[n]) for n in w_up)
