"""The learner's NVFP4 op functions on the Triton kernels (interpreter on the CPU) vs the reference backend.

Every quantisation is bitwise equal between the backends (tests/kernels/test_nvfp4_*), so forward, dgrad and wgrad
may differ only by the fp32 summation of the kernels against the reference's exact sums (tolerance below).
"""
import pytest
import torch

from minite.ops import nvfp4_grouped_linear, nvfp4_linear, quantize_expert_weights
from minite.nvfp4 import NVFP4Recipe
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = TOLERANCES["nvfp4_op_kernels_vs_reference"][1]


def _run(fn, backend, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(backend, *leaves)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.shape[-1], device=y.device))
    return [y.detach()] + [t.grad for t in leaves]


def _close(a, b):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= RTOL * b.float().abs().max().item(), err


@pytest.mark.parametrize("counts", [[10, 0, 17, 21], [16, 16, 0, 16]])
def test_grouped_linear_kernels_match_reference(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 64, device=DEVICE)
    w = torch.randn(4, 48, 64, device=DEVICE) * torch.tensor([1.0, 0.1, 10.0, 1.0], device=DEVICE)[:, None, None]
    fn = lambda backend, xx, ww: nvfp4_grouped_linear(xx, ww, counts, NVFP4Recipe(), seed=3, backend=backend)  # noqa
    for a, b in zip(_run(fn, "triton", x, w), _run(fn, "reference", x, w)):
        _close(a, b)


def test_dense_linear_kernels_match_reference():
    torch.manual_seed(1)
    x, w = torch.randn(2, 9, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    fn = lambda backend, xx, ww: nvfp4_linear(xx, ww, NVFP4Recipe(), seed=4, backend=backend)  # noqa: E731
    for a, b in zip(_run(fn, "triton", x, w), _run(fn, "reference", x, w)):
        _close(a, b)


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096)] if DEVICE == "cuda" else [(48, 256), (32, 272)])
def test_dense_linear_on_packed_weights_is_the_values_path(n, k):
    """A rollout's dense linear on packed weights (`quantize_weight_packed`: quantize_weight's codes and scales, also
    in the decode order where K % 128 == 0) gives bitwise `nvfp4_linear_forward` on the weight's fp16 block values:
    on a GPU at the slice's QKV and output projection and the rows of every tile default_config gives either side
    (decode batches 1-256, a prefill's 512), under the interpreter at small shapes and, forced, at decode-order tiles
    (the interpreter's own tile reads K 64 at a time, in the plain order); a zero row zero, a large one finite,
    [S, B, K] inputs as [S*B, K], no rows none, the reference's one group its dense GEMM. With
    tests/rollout/test_decode.py::test_packed_weights_give_the_same_bits, the GPU test that proved "dense_packed"
    (minite.strict.fused.PROVEN)."""
    from minite.kernels.nvfp4_gemm import GemmConfig, gemm_triton, grouped_gemm_triton
    from minite.nvfp4 import NVFP4Stack, grouped_gemm
    from minite.ops import nvfp4_linear_forward, nvfp4_linear_forward_packed, quantize_weight, quantize_weight_packed
    from minite.ops.common import quantize_scoped
    g = torch.Generator().manual_seed(n + k)
    recipe = NVFP4Recipe()
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(DEVICE)
    values, packed = quantize_weight(w, recipe, backend="triton"), quantize_weight_packed(w, recipe, backend="triton")
    assert len(packed) == 1 and packed.values is None and torch.equal(packed.data[0], values.data)
    assert torch.equal(packed.scale[0].view(torch.uint8), values.scale.view(torch.uint8))
    assert (packed.decode_data is not None) == (k % 128 == 0)
    for rows in ((1, 8, 16, 17, 32, 33, 64, 256, 512) if DEVICE == "cuda" else (1, 5, 33)):
        x = torch.randn(rows, k, generator=g).bfloat16().to(DEVICE)
        if rows > 2:
            x[1] *= 2.0 ** 60
            x[2] = 0.0
        want = nvfp4_linear_forward(x, values, recipe, backend="triton")
        got = nvfp4_linear_forward_packed(x, packed, recipe, backend="triton")
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (rows, n)
        assert torch.equal(got, want) and bool(got.isfinite().all()), rows
        assert rows <= 2 or bool(got[2].eq(0).all())
        assert torch.equal(nvfp4_linear_forward_packed(x[:, None], packed, recipe, backend="triton"), got[:, None])
        if DEVICE == "cpu" and packed.decode_data is not None:  # the decode order's tiles, forced
            xq = quantize_scoped(x, recipe.activation, seed=None, backend="triton")  # the ops' activation
            one = torch.full((1,), rows, dtype=torch.int32)
            for c in (GemmConfig(16, 32, 128, 4, 1, swap_ab=True), GemmConfig(16, 32, 256, 4, 1)):
                assert torch.equal(grouped_gemm_triton(xq, packed, one, torch.bfloat16, config=c),
                                   gemm_triton(xq, values, torch.bfloat16, config=c)), (rows, c)
    assert nvfp4_linear_forward_packed(x[:0], packed, recipe, backend="triton").shape == (0, n)
    ref = nvfp4_linear_forward_packed(x, quantize_weight_packed(w, recipe, backend="reference"), recipe,
                                      backend="reference")  # one group of every row on the reference too
    assert torch.equal(ref, nvfp4_linear_forward(x, quantize_weight(w, recipe, backend="reference"), recipe,
                                                 backend="reference"))
    with pytest.raises(ValueError, match="one-member NVFP4Stack"):
        nvfp4_linear_forward_packed(x, values, recipe, backend="triton")
    two = NVFP4Stack.from_tensors([values, values])
    with pytest.raises(ValueError, match="needs one member's weights, got 2"):
        grouped_gemm(quantize_scoped(x, recipe.activation, seed=None, backend="triton"), two, None)


def test_dense_dgrad_reads_the_cached_weight_in_place():
    """The dgrad of a cached quantised weight makes no transposed copy of it on the kernels (it would stay cached
    with the weight: 2.5 B per parameter through the rest of the step), and gives the reference's gradient."""
    from minite.ops import quantize_weight
    torch.manual_seed(2)
    x, w = torch.randn(24, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        w_q = quantize_weight(w, NVFP4Recipe(), backend=backend)
        xx = x.clone().requires_grad_()
        nvfp4_linear(xx, w, NVFP4Recipe(), seed=4, weight_q=w_q, backend=backend).sum().backward()
        grads[backend] = xx.grad
        assert (w_q._transposed is None) == (backend == "triton")
    _close(grads["triton"], grads["reference"])


def test_expert_weights_carry_block_values_only_for_the_kernels():
    w = torch.randn(3, 32, 48, device=DEVICE)
    tri = quantize_expert_weights(w, NVFP4Recipe(), backend="triton")
    ref = quantize_expert_weights(w, NVFP4Recipe(), backend="reference")
    assert tri.values is not None and ref.values is None
    assert all(tri[e].equal(ref[e]) for e in range(3))


def test_packed_expert_weights_keep_the_decode_order_and_refill_it_in_place():
    """values=False on the kernels: no fp16 values, the codes also in the decode order and the scales decoded where
    K % 128 == 0 (not for K = 272); an in-place refill writes the new weights' decode order and scales into the old
    tensors; a values cache cannot take a packed one in place."""
    from minite.nvfp4 import decode_order, decode_scales
    from minite.ops.common import refill_in_place
    torch.manual_seed(3)
    old = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    assert old.values is None and torch.equal(old.decode_data, decode_order(old.data))
    assert torch.equal(old.decode_scale, decode_scales(old.scale))
    odd = quantize_expert_weights(torch.randn(2, 32, 272, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    assert odd.values is None and odd.decode_data is None and odd.decode_scale is None
    new = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    ptrs = old.decode_data.data_ptr(), old.decode_scale.data_ptr()
    assert refill_in_place(old, new)
    assert (old.decode_data.data_ptr(), old.decode_scale.data_ptr()) == ptrs
    assert torch.equal(old.decode_data, decode_order(new.data))
    assert torch.equal(old.decode_scale, decode_scales(new.scale))
    vals = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton")
    assert vals.decode_data is None and not refill_in_place(vals, new)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("train_weights", [True, False])
def test_grouped_linear_keeps_its_wgrad_operand_packed(backend, train_weights, monkeypatch):
    """The grouped linear saves no copy of x for its backward: the wgrad's x^T is quantised in the forward and kept
    as packed codes and scales (no block values until the wgrad), and the gradients are bitwise those of the wgrad
    quantising x^T in the backward; with frozen weights nothing of x is kept at all."""
    from minite.ops.grouped import _grouped_wgrad
    torch.manual_seed(4)
    counts = [10, 0, 17, 21]
    x = torch.randn(sum(counts), 64, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16).requires_grad_(train_weights)
    dy = torch.randn(sum(counts), 48, device=DEVICE).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = nvfp4_grouped_linear(x, w, counts, NVFP4Recipe(), seed=5, backend=backend)
    saved = [t for t in saved if t is not None]
    assert not any(t.shape == x.shape for t in saved)  # x itself is not saved
    padded_tokens = sum(c + (-c) % 16 for c in counts)
    packed = [t for t in saved if t.dtype == torch.uint8 and tuple(t.shape) == (64, padded_tokens // 2)]
    assert len(packed) == int(train_weights)  # x^T's codes (0.5 B per element; scales 1/16 B), no block values
    assert not any(t.dtype in (torch.float16, torch.bfloat16, torch.float32) and t.numel() >= x.numel() for t in saved)
    y.backward(dy)
    if train_weights:
        want = _grouped_wgrad(dy, x.detach(), counts, NVFP4Recipe(), 5, backend, w.dtype)
        assert torch.equal(w.grad.view(torch.int16), want.view(torch.int16))
    import minite.ops.grouped as grouped
    calls = []
    monkeypatch.setattr(grouped, "quantize_count_segments", lambda *a, **k: calls.append(1))
    with torch.no_grad():  # no backward follows: nothing quantised for a wgrad, device counts taken as they are
        y0 = nvfp4_grouped_linear(x, w, torch.tensor(counts, device=DEVICE), NVFP4Recipe(), seed=5, backend=backend)
    assert torch.equal(y0, y.detach()) and not calls
    monkeypatch.undo()
    x2 = x.detach().clone().requires_grad_()
    nvfp4_grouped_linear(x2, w.detach().clone().requires_grad_(), counts, NVFP4Recipe(), seed=5,
                         backend=backend).backward(dy)
    assert torch.equal(x.grad, x2.grad)  # dgrad does not depend on what the wgrad kept


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_grouped_linear_takes_device_counts_bitwise(backend):
    """Counts as a tensor (the router's, on the device) give the bits of the same counts as a host list: output, dgrad
    and wgrad. On the kernels they stay a tensor through the backward (the wgrad's segments come from them on the
    device, and x^T is saved with device widths); on a GPU the forward and backward run without a host
    synchronisation (torch's sync debug mode raises on one)."""
    from minite.ops.grouped import backward_needs_host_counts
    torch.manual_seed(7)
    counts = [10, 0, 17, 21, 3]
    x = torch.randn(sum(counts), 64, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(5, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    dy = torch.randn(sum(counts), 48, device=DEVICE).to(torch.bfloat16)
    recipe = NVFP4Recipe()

    def step(c):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = nvfp4_grouped_linear(xl, wl, c, recipe, seed=9, backend=backend)
        y.backward(dy)
        return (y.detach(), xl.grad, wl.grad), saved

    want, _ = step(counts)
    device_counts = torch.tensor(counts, device=DEVICE)
    with torch.enable_grad():
        assert backward_needs_host_counts(x, w.requires_grad_(), recipe, backend) == (backend == "reference")
    w.requires_grad_(False)
    if DEVICE == "cuda" and backend == "triton":
        step(device_counts)  # compiled and warm first: the sync debug mode sees the step itself
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        got, saved = step(device_counts)
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    for g, h in zip(got, want):
        assert torch.equal(g.view(torch.int16), h.view(torch.int16))
    with pytest.raises(ValueError, match="summing to the 51 input rows"):  # host counts are checked (for free)
        nvfp4_grouped_linear(x, w, torch.tensor([10, 0, 17, 21, 4]), recipe, seed=9, backend=backend)
    widths = [t for t in saved if t is not None and t.dtype == torch.int32 and tuple(t.shape) == (5,)]
    assert len(widths) == (backend == "triton")  # the kernels keep device widths for the backward
    if widths:
        assert widths[0].tolist() == [c + (-c) % 16 for c in counts]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_grouped_wgrad_adds_into_megatron_main_grad(backend):
    """A weight with Megatron-Core DDP's fp32 `main_grad` and `grad_added_to_main_grad`: the grouped linear's wgrad is
    added into main_grad by the GEMM (bitwise main_grad + the fp32 dW of the same quantised operands), the flag says
    so, and the gradient autograd receives is a placeholder of the weight's shape (which the DDP hook skips). Two
    micro-batches accumulate; a weight without main_grad gets the bf16 dW as before."""
    from minite.ops.grouped import _grouped_wgrad
    torch.manual_seed(10)
    counts = [10, 0, 17, 21]
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    xs = [torch.randn(sum(counts), 64, device=DEVICE).to(torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(sum(counts), 48, device=DEVICE).to(torch.bfloat16) for _ in range(2)]
    param = torch.nn.Parameter(w.clone())
    param.main_grad = torch.randn(4, 48, 64, device=DEVICE) * 1e-2
    param.grad_added_to_main_grad = False
    want = param.main_grad.clone()
    for i, (x, dy) in enumerate(zip(xs, dys)):
        nvfp4_grouped_linear(x, param, counts, NVFP4Recipe(), seed=20 + i, backend=backend).backward(dy)
        want += _grouped_wgrad(dy, x, counts, NVFP4Recipe(), 20 + i, backend, torch.float32)
        assert param.grad_added_to_main_grad and param.grad.shape == w.shape
        param.grad = None
    assert torch.equal(param.main_grad, want)
    plain = w.clone().requires_grad_()
    nvfp4_grouped_linear(xs[0], plain, counts, NVFP4Recipe(), seed=20, backend=backend).backward(dys[0])
    assert torch.equal(plain.grad.view(torch.int16),
                       _grouped_wgrad(dys[0], xs[0], counts, NVFP4Recipe(), 20, backend, w.dtype).view(torch.int16))


@pytest.mark.parametrize("backend,tensor_counts", [("reference", False), ("triton", False), ("triton", True)])
def test_deferred_wgrads_add_the_micro_batches_bitwise(backend, tensor_counts):
    """minite.ops.grouped.DeferredWgrads: three micro-batches' grouped-linear backwards with a wgrad sink leave
    main_grad untouched until `flush`, which then gives main_grad bitwise as the per-micro-batch additions (the
    kernels: one multi-pass launch over the three micro-batches' segments, host or device widths); with max_passes=2
    the first two are added when the second arrives and the third at the flush, to the same bits; `clear` drops
    pending wgrads unapplied."""
    from minite.ops.grouped import DeferredWgrads
    torch.manual_seed(11)
    counts = [[10, 0, 17, 21], [16, 5, 0, 27], [0, 0, 33, 15]]
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    xs = [torch.randn(48, 64, device=DEVICE).to(torch.bfloat16) for _ in counts]
    dys = [torch.randn(48, 48, device=DEVICE).to(torch.bfloat16) for _ in counts]
    start = torch.randn(4, 48, 64, device=DEVICE) * 1e-2
    mains = []
    for sink in (None, DeferredWgrads(backend, max_passes=8), DeferredWgrads(backend, max_passes=2)):
        param = torch.nn.Parameter(w.clone())
        param.main_grad, param.grad_added_to_main_grad = start.clone(), False
        held = []
        for i, (x, dy, c) in enumerate(zip(xs, dys, counts)):
            c = torch.tensor(c, device=DEVICE) if tensor_counts else c
            nvfp4_grouped_linear(x, param, c, NVFP4Recipe(), seed=30 + i, backend=backend,
                                 wgrad_sink=sink).backward(dy)
            assert param.grad_added_to_main_grad and param.grad.shape == w.shape
            param.grad = None
            held.append(None if sink is None else (len(sink), torch.equal(param.main_grad, start)))
        if sink is not None:
            assert held == ([(1, True), (2, True), (3, True)] if sink.max_passes == 8
                            else [(1, True), (0, False), (1, False)])
            sink.flush()
            assert len(sink) == 0
        mains.append(param.main_grad)
    assert not torch.equal(mains[0], start)
    assert torch.equal(mains[0].view(torch.int32), mains[1].view(torch.int32))
    assert torch.equal(mains[0].view(torch.int32), mains[2].view(torch.int32))
    sink = DeferredWgrads(backend, max_passes=8)
    param = torch.nn.Parameter(w.clone())
    param.main_grad, param.grad_added_to_main_grad = start.clone(), False
    y = nvfp4_grouped_linear(xs[0], param, counts[0], NVFP4Recipe(), seed=30, backend=backend, wgrad_sink=sink)
    y.backward(dys[0])
    sink.clear()
    sink.flush()
    assert torch.equal(param.main_grad, start)


@pytest.mark.parametrize("backend,passes", [("reference", 1), ("triton", 1), ("triton", 2)])
def test_main_grad_marked_zeroed_is_written_by_the_first_wgrad(backend, passes):
    """`mark_main_grads_zeroed` (the Learner, after zeroing Megatron's buffers): the first micro-batch's wgrad writes
    main_grad instead of adding to it, the later ones add, and main_grad ends bitwise as the additions into zeros;
    the mark is gone after the first. On the kernels the buffer is not read at all: NaN in a buffer marked zeroed is
    overwritten (a broken promise shows). At once (passes 1) and through DeferredWgrads (passes 2); the reference
    backend adds as always (it only keeps the mark's bookkeeping)."""
    from minite.ops.grouped import MAIN_GRAD_ZEROED, DeferredWgrads, mark_main_grads_zeroed
    torch.manual_seed(12)
    counts = [[10, 0, 17, 21], [16, 5, 0, 27]]
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    xs = [torch.randn(48, 64, device=DEVICE).to(torch.bfloat16) for _ in counts]
    dys = [torch.randn(48, 48, device=DEVICE).to(torch.bfloat16) for _ in counts]
    mains = []
    for mark in (False, True):
        param = torch.nn.Parameter(w.clone())
        fill = float("nan") if mark and backend == "triton" else 0.0
        param.main_grad, param.grad_added_to_main_grad = torch.full(w.shape, fill, device=DEVICE), False
        bare = torch.nn.Parameter(w.clone())
        mark_main_grads_zeroed([param, bare], mark)
        assert getattr(param, MAIN_GRAD_ZEROED) is mark and not hasattr(bare, MAIN_GRAD_ZEROED)  # no main_grad
        sink = DeferredWgrads(backend, max_passes=passes) if passes > 1 else None
        for i, (x, dy, c) in enumerate(zip(xs, dys, counts)):
            nvfp4_grouped_linear(x, param, c, NVFP4Recipe(), seed=40 + i, backend=backend,
                                 wgrad_sink=sink).backward(dy)
            assert getattr(param, MAIN_GRAD_ZEROED) is False
            param.grad = None
        if sink is not None:
            sink.flush()
        mains.append(param.main_grad)
    assert not torch.isnan(mains[1]).any() and not torch.equal(mains[0], torch.zeros_like(mains[0]))
    assert torch.equal(mains[0].view(torch.int32), mains[1].view(torch.int32))


def test_deferred_wgrads_on_device_counts_flush_without_a_host_synchronisation():
    """DeferredWgrads on device counts (the learner's micro-batches on the kernels): the flush builds its passes'
    segment table without a host synchronisation (a pageable copy of the table's offsets was one per flush: 32 in an
    8-micro-batch step of the 4-layer slice, H100 profile, 2026-12-05), and main_grad ends bitwise as with each wgrad
    added at once. On a GPU the backward passes and the flush run under torch's sync debug mode, which raises on
    one; on the CPU the bits are what is checked."""
    from minite.ops.grouped import DeferredWgrads
    torch.manual_seed(13)
    counts = [torch.tensor(c, device=DEVICE) for c in ([10, 0, 17, 21], [16, 5, 0, 27], [3, 30, 9, 6])]
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    xs = [torch.randn(48, 64, device=DEVICE).to(torch.bfloat16) for _ in counts]
    dys = [torch.randn(48, 48, device=DEVICE).to(torch.bfloat16) for _ in counts]

    def run(passes, debug=False):
        param = torch.nn.Parameter(w.clone())
        param.main_grad, param.grad_added_to_main_grad = torch.zeros(w.shape, device=DEVICE), False
        sink = DeferredWgrads("triton", max_passes=passes) if passes > 1 else None
        ys = [nvfp4_grouped_linear(x, param, c, NVFP4Recipe(), seed=50 + i, backend="triton", wgrad_sink=sink)
              for i, (x, c) in enumerate(zip(xs, counts))]
        if debug:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for y, dy in zip(ys, dys):
                y.backward(dy)
                param.grad = None
            if sink is not None:
                sink.flush()
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode("default")
        return param.main_grad

    want = run(1)
    run(2)  # compiled and warm: the sync debug mode sees the passes alone
    got = run(2, debug=DEVICE == "cuda")
    assert not torch.equal(want, torch.zeros_like(want))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("counts", [[5, 0, 11, 16], [1, 0, 0, 0]])
def test_swiglu_fc2_in_one_launch_gives_the_three_steps_bits(counts, strict, monkeypatch):
    """`nvfp4_swiglu_fc2_forward` on the kernels (the SwiGLU, FC2's activation quantisation and the NaN/Inf record
    in one launch) gives the bits of swiglu, then `nvfp4_grouped_linear_forward`, and records max |a| in the flag as
    `FiniteFlag.record` would. The quantiser is told not to check on the spot, as on a GPU (the CPU quantiser checks
    itself, and the fused path is taken only where it does not)."""
    from minite.ops import FiniteFlag, nvfp4_grouped_linear_forward, nvfp4_swiglu_fc2_forward, swiglu
    import minite.ops.grouped as grouped

    from minite.nvfp4 import backend
    monkeypatch.setattr(grouped, "quantiser_checks_finite", lambda t: False)
    routes = grouped.strict_fused.routes
    monkeypatch.setattr(grouped.strict_fused, "routes", lambda *a, **k: True)  # strict's kernels also under the interpreter
    launches = []
    fused_kernel = backend.kernel("expert_swiglu_quantize")
    monkeypatch.setitem(backend._KERNELS, "expert_swiglu_quantize", lambda *a, **k: launches.append(1) or
                        fused_kernel(*a, **k))
    strict_kernel = grouped.fused_swiglu.swiglu_quantize
    monkeypatch.setattr(grouped.fused_swiglu, "swiglu_quantize", lambda *a, **k: launches.append(1) or
                        strict_kernel(*a, **k))
    g = torch.Generator().manual_seed(sum(counts))
    rows, f = sum(counts), 48
    h = (torch.randn(rows, 2 * f, generator=g) * 3).bfloat16().to(DEVICE)
    probs = torch.rand(rows, generator=g).to(DEVICE)
    w_q = quantize_expert_weights(torch.randn(4, 32, f, generator=g).to(DEVICE), NVFP4Recipe(), backend="triton")
    tpe = torch.tensor(counts, device=DEVICE)
    fused_flag, plain_flag = FiniteFlag(), FiniteFlag()
    got = nvfp4_swiglu_fc2_forward(h, probs, w_q, tpe, NVFP4Recipe(), backend="triton", finite=fused_flag,
                                   strict=strict)
    if strict:
        with monkeypatch.context() as mp:
            mp.setattr(grouped.strict_fused, "routes", routes)
            mp.setattr(grouped.strict_fused, "PROVEN", set())  # strict mode's torch ops
            a = swiglu(h, probs, strict=True)
    elif DEVICE == "cpu":  # the interpreter's exp is numpy's: the same arithmetic written with it (test_swiglu.py)
        import numpy as np
        gate, up = h[:, :f].float(), h[:, f:].float()
        a = (gate / (1.0 + torch.from_numpy(np.exp((-gate).numpy()))) * up * probs[:, None]).bfloat16()
    else:
        a = swiglu(h, probs, strict=False)
    plain_flag.record(a)
    want = nvfp4_grouped_linear_forward(a, w_q, tpe, NVFP4Recipe(), backend="triton")
    assert torch.equal(got, want) and launches == [1]
    assert torch.equal(fused_flag.tensor(h.device), plain_flag.tensor(h.device))
    h[0, f] = float("nan")  # an up value of row 0
    nvfp4_swiglu_fc2_forward(h, probs, w_q, tpe, NVFP4Recipe(), backend="triton", finite=fused_flag, strict=strict)
    with pytest.raises(ValueError, match="NaN or Inf reached an NVFP4 quantiser"):
        fused_flag.check("the test")
