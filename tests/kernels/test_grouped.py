"""Grouped NVFP4 (minite.nvfp4.grouped): the Triton paths vs the reference loop, under TRITON_INTERPRET=1 on the CPU.

Quantisation of expert stacks and of wgrad column segments is bitwise equal to quantising each member alone with the
reference (codes, scales, global scales, block values); the segmented GEMM is within the fp32-accumulation bound of
the reference and bitwise equal to the per-expert dense kernel.
"""
import numpy as np
import pytest
import torch

from minite.nvfp4 import (NVFP4Stack, gemm_reference, grouped_gemm, quantize_column_segments, quantize_reference,
                          quantize_stack, segmented_gemm)
from minite.kernels.nvfp4_gemm import gemm_triton
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = TOLERANCES["nvfp4_gemm_fp32_acc"][0] if DEVICE == "cpu" else TOLERANCES["nvfp4_gemm_tensorcore_acc"][0]
TINY = TOLERANCES["fp32_subnormal_floor"][0]


def _bits_equal(a, b):
    """Codes, scales, global scales bitwise; block values by value (the kernel writes +0 where the reference has -0
    for code 8, which no fp32 accumulation starting from +0 can tell apart)."""
    return a.equal(b) and (a.values is None) == (b.values is None) and \
        (a.values is None or torch.equal(a.values, b.values))


def _experts(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-3, 2, e)[:, None, None]  # very different amax per expert
    w[1] = 0.0  # an all-zero expert (global scale 1)
    w[2, 0, :16] = 448 * 6 * 1e4  # a block far above the rest: saturating block scales elsewhere in that expert
    return w.to(DEVICE)


@pytest.mark.parametrize("values", [False, True])
def test_quantize_stack_bitwise_per_expert(values):
    w = _experts(4, 32, 48, 0)
    tri = quantize_stack(w, values=values, backend="triton")
    ref = quantize_stack(w, values=values, backend="reference")
    assert isinstance(tri, NVFP4Stack) and len(tri) == 4
    for e in range(4):
        alone = quantize_reference(w[e], block=(16, 16), scale_scope="tensor", rounding="nearest", seed=None,
                                   rht=False)
        assert alone.equal(tri[e]) and alone.equal(ref[e])
        assert _bits_equal(tri[e], ref[e])
        if values:
            assert torch.equal(tri[e].values, alone.block_values(torch.float16))


def test_stack_transpose_is_each_members_transpose():
    w = _experts(3, 32, 64, 1)
    st = quantize_stack(w, values=True, backend="triton")
    for e in range(3):
        assert _bits_equal(st.t()[e], st[e].t())
    assert st.t() is st.t()  # computed once


@pytest.mark.parametrize("rounding,rht", [("nearest", False), ("nearest", True), ("stochastic", True),
                                          ("stochastic", False)])
@pytest.mark.parametrize("hidden", [40, 48])  # 48: rows a multiple of 16, the kernels' aligned-rows variant
def test_column_segments_bitwise_per_segment(rounding, rht, hidden):
    torch.manual_seed(3)
    widths = [32, 0, 16, 80, 48]
    total = sum(widths)
    tokens = torch.randn(total, hidden) * torch.linspace(0.01, 50, total)[:, None]
    tokens[32 + 16:32 + 16 + 80] *= 1e-3  # one segment far smaller than the others
    x = tokens.to(DEVICE).t()  # [hidden, total], a strided view as the learner passes it
    seeds = [11, 12, 13, 14, 15]
    kw = dict(rounding=rounding, seeds=seeds if rounding == "stochastic" else None, rht=rht, values=True)
    tri = quantize_column_segments(x, widths, backend="triton", **kw)
    ref = quantize_column_segments(x, widths, backend="reference", **kw)
    assert torch.equal(tri.global_scale, ref.global_scale)
    assert tri.global_scale[1].item() == 1.0  # the empty segment
    start = 0
    for e, w in enumerate(widths):
        if w:
            alone = quantize_reference(x[:, start:start + w].contiguous(), block=(1, 16), scale_scope="tensor",
                                       rounding=rounding, seed=seeds[e], rht=rht)
            assert alone.equal(tri.segment(e)) and alone.equal(ref.segment(e))
        start += w
    assert torch.equal(tri.data, ref.data) and torch.equal(tri.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(tri.values, ref.values)


def test_segmented_gemm_matches_reference_and_dense_kernel():
    torch.manual_seed(4)
    widths = [48, 0, 16, 64]
    total = sum(widths)
    dy, x = torch.randn(total, 32).to(DEVICE), (torch.randn(total, 48) * 4).to(DEVICE)
    seeds = [1, 2, 3, 4]
    a = quantize_column_segments(dy.t(), widths, rounding="stochastic", seeds=seeds, rht=True, values=True,
                                 backend="triton")
    b = quantize_column_segments(x.t(), widths, rht=True, values=True, backend="triton")
    out = segmented_gemm(a, b, backend="triton")
    ref = segmented_gemm(a, b, backend="reference")
    assert out.shape == (4, 32, 48) and torch.equal(out[1], torch.zeros(32, 48, device=DEVICE))
    for e, w in enumerate(widths):
        if not w:
            continue
        sa, sb = a.segment(e), b.segment(e)
        bound = (sa.block_values(torch.float64).abs() @ sb.block_values(torch.float64).abs().t()) * \
            (sa.amax.double() * sb.amax.double()).abs() / 2688.0 ** 2
        err = (out[e].double() - ref[e].double()).abs()
        assert torch.all(err <= ATOL * bound + TINY)
        assert torch.equal(out[e], gemm_triton(sa, sb))  # same K order as the dense kernel: bitwise
    # packed operands (no values) give the same bits as block values
    a.values = b.values = None
    assert torch.equal(segmented_gemm(a, b, backend="triton"), out)


def test_grouped_gemm_accepts_a_stack():
    torch.manual_seed(5)
    w = _experts(3, 32, 48, 2)
    st = quantize_stack(w, values=True, backend="triton")
    counts = [5, 0, 11]
    a = quantize_reference(torch.randn(16, 48).to(DEVICE), block=(1, 16), scale_scope="row", rounding="nearest",
                           seed=None, rht=False)
    out = grouped_gemm(a, st, counts, backend="triton")
    assert torch.equal(out, grouped_gemm(a, list(st), counts, backend="triton"))
    ref = grouped_gemm(a, st, counts, backend="reference")
    assert (out - ref).abs().max() <= TOLERANCES["nvfp4_op_kernels_vs_reference"][1] * ref.abs().max()


def test_values_only_stack_multiplies_as_the_full_one():
    """drop_codes: a stack without its packed codes gives the kernels' GEMMs (forward and dgrad's transposed read)
    bitwise the full stack's results, and says so in one line where the codes would be needed."""
    torch.manual_seed(7)
    full = quantize_stack(_experts(3, 48, 32, 4), values=True, backend="triton")
    bare = NVFP4Stack(full.data.clone(), full.scale, full.global_scale, full.shape, full.block, full.values,
                      full.amax).drop_codes()
    assert bare.data is None and len(bare) == 3
    counts = [7, 0, 9]
    for k, trans in ((32, False), (48, True)):
        a = quantize_reference(torch.randn(16, k).to(DEVICE), block=(1, 16), scale_scope="row", rounding="nearest",
                               seed=None, rht=False)
        assert torch.equal(grouped_gemm(a, bare, counts, backend="triton", transpose_weights=trans),
                           grouped_gemm(a, full, counts, backend="triton", transpose_weights=trans))
    for use in (lambda: bare[0], bare.t, lambda: grouped_gemm(a, bare, counts, backend="reference"),
                bare.keep_decode_order):
        with pytest.raises(ValueError, match="block values only"):
            use()
    with pytest.raises(ValueError, match="no block values"):
        quantize_stack(_experts(3, 16, 16, 5), backend="triton").drop_codes()
    with pytest.raises(ValueError, match="codes .* or its block values"):
        NVFP4Stack(None, full.scale, full.global_scale, full.shape, full.block)


def test_stack_checks_and_drops_its_decode_scales():
    """NVFP4Stack.decode_scale (fp16 [E, R/br, C/16], `decode_scales`) is checked like the other fields and freed with
    the codes it serves (drop_codes)."""
    from minite.nvfp4 import decode_scales
    full = quantize_stack(_experts(3, 32, 128, 8), values=True, backend="triton")
    with pytest.raises(ValueError, match=r"NVFP4Stack.decode_scale: expected torch.float16 \(3, 2, 8\)"):
        NVFP4Stack(full.data, full.scale, full.global_scale, full.shape, full.block, decode_scale=full.scale)
    st = NVFP4Stack(full.data, full.scale, full.global_scale, full.shape, full.block, full.values, full.amax,
                    decode_scale=decode_scales(full.scale))
    assert st.drop_codes().decode_scale is None


def test_errors():
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_column_segments(torch.randn(4, 40, device=DEVICE), [24, 16])
    with pytest.raises(ValueError, match="seeds"):
        quantize_column_segments(torch.randn(4, 32, device=DEVICE), [16, 16], rounding="stochastic", seeds=[1])
    from minite.kernels.nvfp4_segments import quantize_segments_triton
    with pytest.raises(ValueError, match="columns read"):
        quantize_segments_triton(torch.randn(4, 48, device=DEVICE), [(0, 8, 4, 16, 0, 0, 17)], (4, 16))
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_segments_triton(torch.randn(4, 48, device=DEVICE), [(0, 8, 4, 12, 0, 0)], (4, 16))
    with pytest.raises(ValueError, match=r"integer array \[B, 7\]"):
        quantize_segments_triton(torch.randn(4, 48, device=DEVICE), np.zeros((2, 6), dtype=np.int64), (4, 16))
    with pytest.raises(ValueError, match="columns read"):  # a table array is checked as the tuples are
        quantize_segments_triton(torch.randn(4, 48, device=DEVICE), np.array([[0, 8, 4, 16, 0, 0, 17]]), (4, 16))
    x = torch.randn(2, 16, 16, device=DEVICE)
    x[1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_stack(x)
    with pytest.raises(ValueError, match=r"\[E, R, C\]"):
        quantize_stack(torch.randn(16, 16, device=DEVICE))


def test_grouped_gemm_transposed_weights_bitwise():
    """dgrad: a_e @ w_e read from the forward stack's values in place == the same GEMM on the transposed stack."""
    torch.manual_seed(6)
    st = quantize_stack(_experts(3, 48, 32, 3), values=True, backend="triton")
    counts = [7, 0, 9]
    a = quantize_reference(torch.randn(16, 48).to(DEVICE), block=(1, 16), scale_scope="tensor",
                           rounding="stochastic", seed=5, rht=False)
    got = grouped_gemm(a, st, counts, backend="triton", transpose_weights=True)
    assert got.shape == (16, 32)
    assert torch.equal(got, grouped_gemm(a, st.t(), counts, backend="triton"))
    assert torch.equal(got, grouped_gemm(a, [w.t() for w in st], counts, backend="triton"))
    ref = grouped_gemm(a, st, counts, backend="reference", transpose_weights=True)
    assert torch.equal(ref, grouped_gemm(a, st.t(), counts, backend="reference"))
    assert (got - ref).abs().max() <= TOLERANCES["nvfp4_op_kernels_vs_reference"][1] * ref.abs().max()


def test_stack_with_per_row_global_scales():
    """ModelOpt-style expert weights: (1, 16) blocks, some experts with per-row global scales (gate and up halves
    scaled differently), others with one; the stack keeps them per row and every path gives the list's result."""
    torch.manual_seed(7)
    ws = []
    for e in range(3):
        q = quantize_reference(torch.randn(32, 48).to(DEVICE), block=(1, 16), scale_scope="tensor",
                               rounding="nearest", seed=None, rht=False)
        if e != 1:  # two halves with different global scales -> per-row
            gs = torch.cat([q.global_scale.expand(16), 2 * q.global_scale.expand(16)]).contiguous()
            amax = torch.cat([q.amax.expand(16), 2 * q.amax.expand(16)]).contiguous()
            q = type(q)(q.data, q.scale, gs, q.shape, q.block, amax=amax)
        ws.append(q)
    st = NVFP4Stack.from_tensors(ws)
    assert st.global_scale.shape == (3, 32)
    counts = [4, 7, 5]
    a = quantize_reference(torch.randn(16, 48).to(DEVICE), block=(1, 16), scale_scope="row", rounding="nearest",
                           seed=None, rht=False)
    ref = grouped_gemm(a, ws, counts, backend="reference")
    assert torch.equal(grouped_gemm(a, st, counts, backend="reference"), ref)
    tri = grouped_gemm(a, st, counts, backend="triton")
    assert torch.equal(tri, grouped_gemm(a, ws, counts, backend="triton"))
    assert (tri - ref).abs().max() <= TOLERANCES["nvfp4_op_kernels_vs_reference"][1] * ref.abs().max()
    with pytest.raises(ValueError, match="one global scale per member"):
        st.t()


def test_stack_amax_is_the_amax_kernels_value():
    """quantize_stack's amax (one torch reduction, minite.nvfp4.grouped.stack_amax) is bitwise the segments amax
    kernel's on finite inputs (random, all zero, -0 only, an Inf), and NaN where a member holds a NaN, as the
    kernel's (NaN-propagating: kernels/nvfp4_quant.py `_nan_max`) and the reference's."""
    from minite.kernels.nvfp4_segments import quantize_segments_triton
    from minite.nvfp4.grouped import stack_amax

    w = _experts(5, 32, 48, 1)
    w[3] = -0.0
    w[4, 2, 7] = float("inf")
    flat = w.reshape(-1, 48)
    segs = [(i * 32, 0, 32, 48, i * 32, 0) for i in range(5)]
    kernel_amax = quantize_segments_triton(flat, segs, (160, 48), (16, 16))[3]
    given_amax = quantize_segments_triton(flat, segs, (160, 48), (16, 16), amax=stack_amax(w))[3]
    assert torch.equal(kernel_amax, given_amax)
    assert stack_amax(w).view(torch.int32).equal(w.reshape(5, -1).abs().amax(dim=1).float().view(torch.int32))
    w[0, 1, 1] = float("nan")
    assert torch.isnan(stack_amax(w)[0]) and not torch.isnan(stack_amax(w)[1:]).any()
    kernel_amax = quantize_segments_triton(w.reshape(-1, 48), segs, (160, 48), (16, 16))[3]
    assert torch.equal(kernel_amax.isnan(), stack_amax(w).isnan())
    assert stack_amax(torch.empty(2, 0, 16, device=DEVICE)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("vec2d", [True, False])
@pytest.mark.parametrize("rounding,rht", [("nearest", False), ("nearest", True), ("stochastic", True)])
def test_segments_pad_themselves_bitwise(rounding, rht, vec2d):
    """Segments that read fewer columns than they hold, from any x column (the wgrad operands of experts whose token
    counts are not multiples of 16, read through the transposed view): the same bits as the reference on explicitly
    zero-padded copies, codes, scales, global scales and fp16 values; an empty segment and a full one beside them."""
    from minite.kernels.nvfp4_segments import quantize_segments_triton
    torch.manual_seed(3)
    counts, widths = [5, 0, 16, 21, 1], [16, 0, 16, 32, 16]
    t = torch.randn(sum(counts), 48, device=DEVICE) * torch.logspace(-2, 2, 48, device=DEVICE)
    xs, ps = np.cumsum([0] + counts[:-1]), np.cumsum([0] + widths[:-1])
    segs = [(0, int(s), 48, w, 0, int(p), c) for s, p, c, w in zip(xs, ps, counts, widths)]
    seeds = [11, 12, 13, 14, 15]
    tune = {"elems": 512, "warps": 2, "vec2d": vec2d, "rows": 16}  # 2-D or 4-D loads, both with element masks
    data, scale, gs, amax, vals = quantize_segments_triton(t.t(), segs, (48, sum(widths)), (1, 16), rounding,
                                                           seeds if rounding == "stochastic" else None, rht,
                                                           torch.float16, tuning=tune)
    for e, (s, p, c, w) in enumerate(zip(xs, ps, counts, widths)):
        if w == 0:
            assert float(gs[e]) == 1.0 and float(amax[e]) == 0.0
            continue
        padded = torch.zeros(w, 48, device=DEVICE)
        padded[:c] = t[s:s + c]
        ref = quantize_reference(padded.t().contiguous(), block=(1, 16), scale_scope="tensor", rounding=rounding,
                                 seed=seeds[e], rht=rht)
        assert torch.equal(data[:, p // 2:(p + w) // 2], ref.data), e
        assert torch.equal(scale[:, p // 16:(p + w) // 16].view(torch.uint8), ref.scale.view(torch.uint8)), e
        assert torch.equal(gs[e], ref.global_scale.reshape(())) and torch.equal(amax[e], ref.amax.reshape(())), e
        assert torch.equal(vals[:, p:p + w], ref.block_values(torch.float16)), e
    # the public entry (the MoE wgrad's call): the kernels against the reference path, which pads a copy
    kw = dict(rounding=rounding, rht=rht, seeds=seeds if rounding == "stochastic" else None, values=True,
              counts=counts)
    tri = quantize_column_segments(t.t(), widths, backend="triton", **kw)
    ref = quantize_column_segments(t.t(), widths, backend="reference", **kw)
    assert torch.equal(tri.data, ref.data) and torch.equal(tri.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(tri.global_scale, ref.global_scale) and torch.equal(tri.values, ref.values)
    with pytest.raises(ValueError, match="reads outside"):
        quantize_segments_triton(t.t(), [(0, 40, 48, 16, 0, 0, 8)], (48, 16))


@pytest.mark.parametrize("case", ["random", "zero", "max", "tiny", "nonfinite"])
def test_segment_values_from_codes_are_the_quantisers(case):
    """`NVFP4Segments.with_values` on segments quantised without values (the MoE wgrad's x^T, kept packed from the
    forward to the backward) writes bitwise the block values the quantiser writes with values=True; for finite
    input also the reference's and `block_values`' (fp16), up to the sign of zero (code 8: the kernels write +0, as
    0 - x, the reference -0; no fp32 sum starting at +0 tells them apart)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(100, 40, generator=g)
    if case == "zero":
        x.zero_()
    elif case == "max":
        x = torch.sign(x) * 3.0e38
    elif case == "tiny":
        x = x * 1e-30
    elif case == "nonfinite":
        x[3, 5], x[50, 7], x[70, 9] = float("nan"), float("inf"), -float("inf")
    x = x.to(torch.bfloat16).to(DEVICE)
    args = dict(counts=[10, 30, 0, 60], rht=True, check_finite=False, backend="triton")
    want = quantize_column_segments(x.t(), [16, 32, 0, 64], values=True, **args)
    packed = quantize_column_segments(x.t(), [16, 32, 0, 64], values=False, **args)
    assert packed.values is None and torch.equal(packed.data, want.data)
    got = packed.with_values("triton").values
    assert torch.equal(got.view(torch.int16), want.values.view(torch.int16))
    if case != "nonfinite":
        ref = quantize_column_segments(x.t(), [16, 32, 0, 64], values=False,
                                       **{**args, "backend": "reference"}).with_values("reference").values
        seg = want.segment(3).block_values(torch.float16)
        for a, b in ((got, ref), (got[:, 48:], seg)):
            assert torch.equal(a, b) and torch.equal(torch.signbit(a[a != 0]), torch.signbit(b[b != 0]))


def test_block_values_kernel_refuses_bad_operands():
    from minite.kernels.nvfp4_values import block_values_triton
    data = torch.zeros(4, 8, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="block_values"):
        block_values_triton(data, torch.zeros(4, 2, device=DEVICE).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="block_values"):
        block_values_triton(data.float(), torch.zeros(4, 1, device=DEVICE).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("rounding,rht", [("nearest", False), ("nearest", True), ("stochastic", True),
                                          ("stochastic", False)])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_count_segments_are_the_table_segments(rounding, rht, layout):
    """Segments found on the device from device counts (the MoE wgrad's operands without a host synchronisation):
    the bits of the host-table launch and of the reference on the same segments, codes, scales, global scales,
    decode amaxes and fp16 values; counts not multiples of 16, empty experts, more experts than one 16-lane block of
    counts, rows not a multiple of 16 (40)."""
    from minite.kernels.nvfp4_segments import count_segments_columns
    from minite.nvfp4 import quantize_count_segments
    torch.manual_seed(5)
    counts = [5, 0, 16, 21, 1, 0, 40, 3] + [7] * 12 + [0, 33]  # 22 experts
    rows = 40 if layout == "transposed" else 48
    t = torch.randn(sum(counts), rows, device=DEVICE) * torch.logspace(-2, 2, sum(counts), device=DEVICE)[:, None]
    x = t.t() if layout == "transposed" else t.t().contiguous()
    seeds = list(range(100, 100 + len(counts)))
    kw = dict(rounding=rounding, rht=rht, seeds=seeds if rounding == "stochastic" else None, values=True)
    dev = quantize_count_segments(x, torch.tensor(counts, device=DEVICE), backend="triton", **kw)
    host = quantize_count_segments(x, counts, backend="triton", **kw)
    ref = quantize_count_segments(x, counts, backend="reference", **kw)
    assert torch.is_tensor(dev.widths) and dev.widths.tolist() == list(host.widths) == list(ref.widths)
    used = sum(host.widths)
    assert dev.data.shape == (rows, count_segments_columns(sum(counts), len(counts)) // 2) and used <= 2 * dev.data.shape[1]
    for q in (host, ref):
        assert torch.equal(dev.data[:, :used // 2], q.data)
        assert torch.equal(dev.scale.view(torch.uint8)[:, :used // 16], q.scale.view(torch.uint8))
        assert torch.equal(dev.global_scale, q.global_scale) and torch.equal(dev.amax, q.amax)
        assert torch.equal(dev.values[:, :used], q.values)
    for e in range(len(counts)):  # device widths read back on the host segment by segment
        assert dev.segment(e).equal(ref.segment(e))
    if DEVICE == "cuda":  # host counts as a tensor (Megatron's alltoall dispatcher under EP): read on the host
        on_host = quantize_count_segments(x, torch.tensor(counts), backend="triton", **kw)
        assert on_host.widths == host.widths and torch.equal(on_host.data, host.data)


def test_segmented_gemm_with_device_widths_is_the_host_ones():
    from minite.nvfp4 import quantize_count_segments
    torch.manual_seed(6)
    counts = [9, 0, 16, 30, 2]
    dy, x = torch.randn(sum(counts), 32, device=DEVICE), torch.randn(sum(counts), 48, device=DEVICE)
    seeds = [1, 2, 3, 4, 5]

    def operands(c):
        return (quantize_count_segments(dy.t(), c, rounding="stochastic", seeds=seeds, rht=True, values=True,
                                        backend="triton"),
                quantize_count_segments(x.t(), c, rht=True, values=True, backend="triton"))

    want = segmented_gemm(*operands(counts), backend="triton")
    a, b = operands(torch.tensor(counts, device=DEVICE))
    assert torch.equal(segmented_gemm(a, b, backend="triton"), want)
    assert torch.equal(segmented_gemm(a, b, backend="reference"), segmented_gemm(*operands(counts),
                                                                                 backend="reference"))
    a.values = b.values = None  # packed operands
    assert torch.equal(segmented_gemm(a, b, backend="triton"), want)
    host_b = operands(counts)[1]
    with pytest.raises(ValueError, match="same counts"):
        segmented_gemm(a, host_b, backend="triton")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_segmented_gemm_accumulates_in_place_bitwise(backend):
    """accumulate=: the fp32 products added to a gradient buffer in place (Megatron's main_grad) are bitwise the
    buffer plus the fp32 result (the kernel's add is not contracted into an FMA with the scale's multiply); an empty
    segment adds zeros. A buffer of the wrong dtype or shape is refused."""
    from minite.nvfp4 import quantize_count_segments
    torch.manual_seed(8)
    counts = [9, 0, 16, 30]
    dy, x = torch.randn(sum(counts), 32, device=DEVICE), torch.randn(sum(counts), 48, device=DEVICE) * 3
    a = quantize_count_segments(dy.t(), counts, rounding="stochastic", seeds=[1, 2, 3, 4], values=True,
                                backend="triton")
    b = quantize_count_segments(x.t(), counts, values=True, backend="triton")
    grad = torch.randn(4, 32, 48, device=DEVICE) * 1e-3
    want = grad + segmented_gemm(a, b, out_dtype=torch.float32, backend=backend)
    buf = grad.clone()
    got = segmented_gemm(a, b, backend=backend, accumulate=buf)
    assert got is buf and torch.equal(buf, want)
    for bad in (grad.to(torch.bfloat16), grad[:3].clone(), grad.transpose(1, 2).contiguous()):
        with pytest.raises(ValueError, match="accumulate"):
            segmented_gemm(a, b, backend=backend, accumulate=bad)


@pytest.mark.parametrize("passes", [1, 2])
def test_zeroed_accumulate_is_written_not_read(passes):
    """zeroed=True (a gradient buffer the caller zeroed and did not add to since): the kernels write the buffer
    without reading it, bitwise what adding into +0.0 gives (the reference's add); a buffer holding NaN instead of
    the promised zeros is overwritten, which shows it was not read. One launch, and the multi-pass launch."""
    from minite.nvfp4 import quantize_count_segments, segmented_gemm_passes
    torch.manual_seed(9)
    counts = [[9, 0, 16, 30], [0, 21, 16, 1]][:passes]
    ops = []
    for i, c in enumerate(counts):
        dy, x = torch.randn(sum(c), 32, device=DEVICE), torch.randn(sum(c), 48, device=DEVICE) * 3
        ops.append((quantize_count_segments(dy.t(), c, rounding="stochastic", seeds=[1 + i, 2, 3, 4], values=True,
                                            backend="triton"),
                    quantize_count_segments(x.t(), c, values=True, backend="triton")))
    want = torch.zeros(4, 32, 48, device=DEVICE)
    segmented_gemm_passes([a for a, _ in ops], [b for _, b in ops], want, backend="reference")
    garbage = torch.full_like(want, float("nan"))
    if passes == 1:
        got = segmented_gemm(*ops[0], backend="triton", accumulate=garbage, zeroed=True)
    else:
        got = segmented_gemm_passes([a for a, _ in ops], [b for _, b in ops], garbage, backend="triton", zeroed=True)
    assert got is garbage and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (want == 0).any()  # the empty segments: +0.0 written
