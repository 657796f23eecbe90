"""Triton W4A4 GEMMs vs the reference (within the fp32-accumulation bound), and bitwise among kernel paths.

Runs under TRITON_INTERPRET=1 on the CPU (conftest.py) at small shapes; tests/kernels/test_kernels_gpu.py repeats it at real shapes.
Bitwise among paths: packed vs block-value operands, M=1 vs a batch, grouped vs dense, tile shapes at fixed BLOCK_K.
"""
import dataclasses
import itertools

import pytest
import torch

from minite.nvfp4 import gemm, grouped_gemm_reference, gemm_reference, quantize_reference, row_slice
from minite.nvfp4.tensor import unpack_codes
from minite.kernels.nvfp4_gemm import (GemmConfig, gemm_triton, grouped_gemm_triton,
                                       stack_expert_weights)
from minite.kernels import nvfp4_gemm
from minite.kernels.nvfp4_wgrad import kgrouped_gemm_triton
from minite.kernels.nvfp4_quant import quantize_with_values_triton
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = TOLERANCES["nvfp4_gemm_fp32_acc"][0] if DEVICE == "cpu" else TOLERANCES["nvfp4_gemm_tensorcore_acc"][0]
TINY = TOLERANCES["fp32_subnormal_floor"][0]


def _q(x, block=(1, 16), scope="row", rounding="nearest", rht=False, seed=11):
    return quantize_reference(x, block=block, scale_scope=scope, rounding=rounding, seed=seed, rht=rht)


def _bound(a, b):
    """sum_k |a_k b_k| * |alpha| per output element (alpha = amax_a amax_b / 2688^2), in float64."""
    mag = a.block_values(torch.float64).abs() @ b.block_values(torch.float64).abs().t()
    ga = a.amax.double()[:, None] if a.per_row else a.amax.double()
    gb = b.amax.double()[None, :] if b.per_row else b.amax.double()
    return mag * (ga * gb).abs() / 2688.0 ** 2


def _assert_close_to_reference(out, ref, bound):
    err = (out.double() - ref.double()).abs()
    assert torch.all(err <= ATOL * bound + TINY), f"max err/bound {(err / (bound + TINY)).max().item()}"


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return _q(torch.randn(n, k, generator=g).to(DEVICE), block=(16, 16), scope="tensor")


@pytest.mark.parametrize("a_scope", ["row", "tensor"])
@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (20, 48, 96), (33, 16, 160)])
def test_dense_matches_reference(m, n, k, a_scope):
    torch.manual_seed(m + n + k)
    a = _q((torch.randn(m, k) * 3).to(DEVICE), scope=a_scope)
    b = _weights(n, k, 0)
    out = gemm_triton(a, b, torch.float32)
    _assert_close_to_reference(out, gemm_reference(a, b), _bound(a, b))
    assert torch.equal(gemm_triton(a, b, torch.bfloat16), out.to(torch.bfloat16))


def test_packed_and_block_value_operands_bitwise():
    torch.manual_seed(1)
    x = torch.randn(20, 96, device=DEVICE)
    a, a_vals = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    b = _weights(48, 96, 1)
    packed = gemm_triton(a, b)
    assert torch.equal(packed, gemm_triton(a, b, a_values=a_vals))
    assert torch.equal(packed, gemm_triton(a, b, a_values=a_vals, b_values=b.block_values(torch.float16)))


def test_packed_decode_every_code_and_scale_bitwise():
    """Every byte of two E2M1 codes and every finite E4M3 scale byte (subnormal scales too): packed weights give the
    bits of their fp16 block values (on the GPU this runs the inline-PTX decode and its 2^-7 operand scaling)."""
    from minite.nvfp4.tensor import NVFP4Tensor
    g = torch.Generator().manual_seed(7)
    n, k = 64, 512
    data = torch.arange(n * k // 2, dtype=torch.int64).remainder(256)
    data = data[torch.randperm(data.numel(), generator=g)].to(torch.uint8).reshape(n, k // 2)
    sbytes = torch.arange(n * k // 16, dtype=torch.int64).remainder(127)  # 0x00..0x7E: 0x7F is NaN
    sbytes = sbytes[torch.randperm(sbytes.numel(), generator=g)].to(torch.uint8).reshape(n, k // 16)
    amax = torch.rand(n, generator=g) + 0.5  # per-row global scales, as activations have
    b = NVFP4Tensor(data.to(DEVICE), sbytes.view(torch.float8_e4m3fn).to(DEVICE), (2688.0 / amax).to(DEVICE), (n, k),
                    (1, 16), amax=amax.to(DEVICE))
    a, a_vals = quantize_with_values_triton(torch.randn(20, k, generator=g).to(DEVICE), (1, 16), "row", "nearest",
                                            None, False)
    b_vals = b.block_values(torch.float16)
    assert torch.equal(b_vals.float(), b.block_values(torch.float32))  # every block value exact in fp16
    ref = gemm_triton(a, b, a_values=a_vals, b_values=b_vals)
    assert torch.equal(gemm_triton(a, b, a_values=a_vals), ref)  # packed weights
    assert torch.equal(gemm_triton(a, b), ref)  # both packed
    _assert_close_to_reference(ref, gemm_reference(a, b), _bound(a, b))


def test_row_output_is_batch_invariant():
    torch.manual_seed(2)
    x = torch.randn(40, 128, device=DEVICE)
    b = _weights(32, 128, 2)
    full = gemm_triton(_q(x), b)
    for i in (0, 17, 39):
        assert torch.equal(gemm_triton(_q(x[i:i + 1]), b), full[i:i + 1])
    assert torch.equal(gemm_triton(_q(x[5:12]), b), full[5:12])


def test_tile_shapes_at_fixed_block_k_bitwise():
    torch.manual_seed(3)
    a = _q(torch.randn(40, 128, device=DEVICE))
    b = _weights(64, 128, 3)
    base = gemm_triton(a, b, config=GemmConfig(16, 32, 64, 4, 1))
    for cfg in (GemmConfig(32, 16, 64, 4, 1), GemmConfig(64, 64, 64, 4, 1)):
        assert torch.equal(gemm_triton(a, b, config=cfg), base)


def test_swapped_operands_match_reference():
    """swap_ab computes out^T = b @ a^T; on the CPU only closeness is checked (bitwise is a question for the GPU tests)."""
    torch.manual_seed(9)
    a = _q(torch.randn(5, 128, device=DEVICE))
    b = _weights(64, 128, 9)
    out = gemm_triton(a, b, config=GemmConfig(16, 32, 64, 4, 1, swap_ab=True))
    _assert_close_to_reference(out, gemm_reference(a, b), _bound(a, b))


@pytest.mark.parametrize("tokens", [[7, 0, 13], [0, 0, 5], [16, 16, 16], [1, 2, 0]])
def test_grouped_matches_reference_and_dense(tokens, monkeypatch):
    torch.manual_seed(sum(tokens))
    t, n, k = sum(tokens), 32, 64
    a = _q(torch.randn(t, k, device=DEVICE))
    ws = [_weights(n, k, 10 + e) for e in range(len(tokens))]
    out = grouped_gemm_triton(a, ws, tokens)
    ref = grouped_gemm_reference(a, ws, tokens)
    start = 0
    for e, c in enumerate(tokens):
        if c:
            sl = row_slice(a, start, start + c)
            _assert_close_to_reference(out[start:start + c], ref[start:start + c], _bound(sl, ws[e]))
            assert torch.equal(out[start:start + c], gemm_triton(sl, ws[e]))
        start += c
    stacked = stack_expert_weights(ws, values=True)
    assert torch.equal(grouped_gemm_triton(a, stacked, torch.tensor(tokens, dtype=torch.int32)), out)
    # the dispatch's int64 counts on the device are read as they are: no int32 copy (a launch a GEMM on a GPU)
    monkeypatch.setattr(nvfp4_gemm, "int32_to", lambda *args: pytest.fail("int64 device counts were copied"))
    assert torch.equal(grouped_gemm_triton(a, stacked, torch.tensor(tokens, device=DEVICE)), out)


def test_grouped_decode_rows_match_training_batch():
    """One token per expert (decode) gives the rows the same tokens get inside a larger grouped batch."""
    torch.manual_seed(4)
    e, n, k = 4, 32, 64
    ws = stack_expert_weights([_weights(n, k, 20 + i) for i in range(e)])
    tokens = [5, 3, 6, 2]
    x = torch.randn(sum(tokens), k, device=DEVICE)
    big = grouped_gemm_triton(_q(x), ws, tokens)
    firsts = [0, 5, 8, 14]
    small = grouped_gemm_triton(_q(x[firsts]), ws, [1, 1, 1, 1])
    assert torch.equal(small, big[firsts])


@pytest.mark.parametrize("tokens", [[16, 0, 48], [32, 32]])
def test_wgrad_grouped_over_k_matches_reference(tokens):
    torch.manual_seed(5)
    t, n, k = sum(tokens), 32, 48
    dy, x = torch.randn(t, n, device=DEVICE), torch.randn(t, k, device=DEVICE)
    a = _q(dy.t().contiguous(), scope="tensor", rounding="stochastic", rht=True)
    b = _q(x.t().contiguous(), scope="tensor", rht=True)
    out = kgrouped_gemm_triton(a, b, tokens)
    start = 0
    for e, c in enumerate(tokens):
        ae = _q_slice_cols(a, start, start + c)
        be = _q_slice_cols(b, start, start + c)
        if c:
            _assert_close_to_reference(out[e], gemm_reference(ae, be), _bound(ae, be))
        else:
            assert torch.equal(out[e], torch.zeros_like(out[e]))
        start += c


def _q_slice_cols(t, s, e):
    from minite.nvfp4 import NVFP4Tensor
    return NVFP4Tensor(t.data[:, s // 2:e // 2].contiguous(), t.scale[:, s // 16:e // 16].contiguous(),
                       t.global_scale, (t.shape[0], e - s), t.block, amax=t.amax)


def test_public_gemm_dispatches_to_triton():
    torch.manual_seed(6)
    a = _q(torch.randn(8, 64, device=DEVICE))
    b = _weights(16, 64, 6)
    assert torch.equal(gemm(a, b, backend="triton"), gemm_triton(a, b))


@pytest.mark.parametrize("m,n,k", [(1, 32, 48), (20, 48, 96), (33, 64, 16)])
def test_transpose_b_reads_block_values_in_place_bitwise(m, n, k):
    """gemm(a, b, transpose_b=True) = a @ b for a 16x16-block b [N, K] (a linear's dgrad): bitwise the GEMM with b's
    exact transpose, on block values read in place (no transposed copy is cached on b) and on packed codes; the
    reference agrees within the fp32-accumulation bound."""
    torch.manual_seed(m + n + k)
    a = _q(torch.randn(m, n, device=DEVICE), rounding="stochastic")
    b = _weights(n, k, 7)
    with_values = type(b)(b.data, b.scale, b.global_scale, b.shape, b.block, b.block_values(torch.float16), b.amax)
    got = gemm(a, with_values, backend="triton", transpose_b=True)
    assert got.shape == (m, k) and with_values._transposed is None
    assert torch.equal(got, gemm_triton(a, b.t()))
    assert torch.equal(got, gemm(a, b, backend="triton", transpose_b=True))  # packed: transposed codes
    ref = gemm(a, b, backend="reference", transpose_b=True)
    assert torch.equal(ref, gemm_reference(a, b.t()))
    _assert_close_to_reference(got, ref, _bound(a, b.t()))
    with pytest.raises(ValueError, match="K mismatch"):
        gemm(_q(torch.randn(m, n + 16, device=DEVICE)), b, backend="triton", transpose_b=True)
    per_row = _q(torch.randn(n, k, device=DEVICE))  # (1, 16) blocks, one scale per row: no exact transpose
    per_row = type(b)(per_row.data, per_row.scale, per_row.global_scale, per_row.shape, per_row.block,
                      per_row.block_values(torch.float16), per_row.amax)
    with pytest.raises(ValueError, match=r"\(16, 16\) blocks and one global scale"):
        gemm(a, per_row, backend="triton", transpose_b=True)


def test_values_only_weight_gives_the_same_gemms():
    """NVFP4Tensor.drop_codes (the learner's released dense weights): the kernels' forward and transposed GEMMs on
    the kept block values are bitwise those of the full tensor; what needs the codes says so in one line."""
    torch.manual_seed(8)
    b = _weights(32, 48, 8)
    full = type(b)(b.data, b.scale, b.global_scale, b.shape, b.block, b.block_values(torch.float16), b.amax)
    bare = type(b)(b.data, b.scale, b.global_scale, b.shape, b.block, full.values, b.amax).drop_codes()
    assert bare.data is None and torch.equal(bare.block_values(), b.block_values())
    a, g = _q(torch.randn(20, 48, device=DEVICE)), _q(torch.randn(20, 32, device=DEVICE))
    assert torch.equal(gemm(a, bare, backend="triton"), gemm(a, full, backend="triton"))
    assert torch.equal(gemm(g, bare, backend="triton", transpose_b=True),
                       gemm(g, full, backend="triton", transpose_b=True))
    for use in (bare.codes, lambda: bare.equal(b)):
        with pytest.raises(ValueError, match="block values only"):
            use()
    with pytest.raises(ValueError, match="no block values"):
        _weights(16, 16, 1).drop_codes()
    with pytest.raises(ValueError, match="codes .* or its block values"):
        type(b)(None, b.scale, b.global_scale, b.shape, b.block)
    with pytest.raises(ValueError, match="ExpertWeights without block values"):
        grouped_gemm_triton(g, stack_expert_weights([b]), [20], transpose_weights=True)


def test_decode_order_words_hold_the_documented_bits():
    """decode_order's words, read as minite.nvfp4.grouped.DECODE_BLOCK says (word 4t + q of a 128-code block, pair
    i's magnitudes at WORD_MAG_BIT[i] and sign at WORD_SIGN_BIT[i] of half h), give back every code in K order."""
    from minite.nvfp4 import decode_order
    from minite.nvfp4.grouped import WORD_MAG_BIT, WORD_SIGN_BIT
    torch.manual_seed(10)
    data = torch.randint(0, 256, (3, 128), dtype=torch.uint8)  # two 128-code blocks a row
    codes = unpack_codes(data)
    words = decode_order(data).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # little-endian bytes
    got = torch.empty_like(codes)
    for blk, t, q, i, h in itertools.product(range(2), range(4), range(4), range(4), range(2)):
        w = words[:, blk * 16 + 4 * t + q]
        mag = (w >> (16 * h + WORD_MAG_BIT[i])) & 7
        sign = (w >> (16 * h + WORD_SIGN_BIT[i])) & 1
        got[:, blk * 128 + 32 * q + 16 * (i // 2) + 8 * (i % 2) + 2 * t + h] = (mag | sign << 3).to(torch.uint8)
    assert torch.equal(got, codes)


def test_default_tiles_fill_the_gpu_at_decode_sizes():
    """default_config's GPU tiles: the training tile where a launch has programs for every SM, a 64x64 tile for a
    dense layer at a rollout's batch of up to 256 rows (the training tile would leave most SMs idle), decode tiles for
    few rows per expert, 128 columns wide for packed weights in the decode order, K 256 at a time for the experts'
    FC1 (K >= 2048) at up to 8 rows per expert in the decode order; a dense linear on packed weights in the decode
    order (one group) at up to 256 rows takes swapped 16-row tiles (K 256 at a time) to 64 rows, 32-row ones above."""
    from minite.kernels.nvfp4_gemm import FEW_PROGRAMS, default_config
    train = default_config(1024, False, rows=131072, n=1536)
    assert (train.block_m, train.block_n) == (128, 256)
    proj = default_config(256, False, rows=256, n=2048)
    assert (proj.block_m, proj.block_n) == (64, 64)
    assert -(-256 // 128) * -(-2048 // 256) < FEW_PROGRAMS <= -(-4096 // 128) * -(-2048 // 256)
    assert (default_config(256, False, rows=4096, n=2048).block_m, default_config(256, False).block_m) == (128, 128)
    assert default_config(512, False, rows=512, n=640).block_m == 128  # few programs, but more rows than measured
    ordered = default_config(16, False, packed=True, ordered=True)
    plain = default_config(16, False, packed=True)
    assert (ordered.block_m, ordered.block_n, ordered.swap_ab) == (32, 128, True) and plain.block_n == 64
    assert default_config(4, False, packed=True, ordered=True).block_m == 16
    fc1, fc2 = (default_config(4, False, packed=True, ordered=True, k=k) for k in (2048, 768))
    assert (fc1.block_k, fc1.num_stages, fc2.block_k, fc2.num_stages) == (256, 3, 128, 4)
    assert default_config(4, False, packed=True, k=2048).block_k == 128  # packed, not in the decode order
    dense = [default_config(r, False, packed=True, ordered=True, rows=r, n=5120, k=2048, dense=True)
             for r in (1, 64, 65)]
    assert [(c.block_m, c.block_k, c.swap_ab) for c in dense] == [(16, 256, True), (16, 256, True), (32, 128, True)]
    assert default_config(64, False, packed=True, ordered=True, rows=64, k=1152, dense=True).block_k == 128  # K % 256
    assert default_config(300, False, packed=True, ordered=True, rows=300, n=5120, k=2048, dense=True).block_m == 128
    one_expert = default_config(64, False, packed=True, ordered=True, rows=64, n=5120, k=2048)  # counts: the experts'
    assert (one_expert.block_m, one_expert.swap_ab) == (64, False)


def test_decode_scales_are_the_loops_decode_of_every_byte():
    """decode_scales gives, for each of the 256 scale bytes, the fp16 the packed decode computes in its loop
    ((bits & 0x7F) << 7 as fp16, times 2^15): scale x 2^7 exactly for every finite E4M3 scale, the sign bit ignored,
    the NaN byte read as 480; the shape and dtype follow the scales'."""
    from minite.nvfp4 import decode_scales
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_scales(b.view(torch.float8_e4m3fn)).reshape(2, 128)
    assert got.dtype == torch.float16 and torch.equal(got[0], got[1])  # bit 7 (the sign) ignored
    e4m3 = b[:127].view(torch.float8_e4m3fn).float()
    assert torch.equal(got[0, :127].float(), e4m3 * 128)
    assert got[0, 127].item() == 480 * 128  # 0x7F, E4M3's NaN, as the bit decode reads it
    assert decode_scales(torch.zeros(3, 2, 8, dtype=torch.float8_e4m3fn)).shape == (3, 2, 8)


def test_decode_order_weights_bitwise():
    """Expert weights whose codes are also kept in the decode order give the bits of the plain order, with tiles
    that read that order (BLOCK_K % 128 == 0) and tiles that cannot (they read the plain codes); the decode order's
    fp16 scales (`decode_scales`) and its scale bytes decoded in the loop give the same bits."""
    from minite.nvfp4 import decode_order, decode_scales
    torch.manual_seed(9)
    experts, n, k = 3, 32, 256
    ws = [_weights(n, k, 20 + e) for e in range(experts)]
    plain = stack_expert_weights(ws)
    ordered = stack_expert_weights(ws, decode=True)
    assert not torch.equal(ordered.decode_data, plain.data)
    assert torch.equal(decode_order(plain.data), ordered.decode_data)
    counts = [2, 0, 5]
    a, a_vals = quantize_with_values_triton(torch.randn(sum(counts), k, device=DEVICE), (1, 16), "row", "nearest",
                                            None, False)
    for cfg in (GemmConfig(16, 32, 128, 4, 1, swap_ab=True), GemmConfig(16, 32, 256, 4, 1), GemmConfig(16, 32, 64, 4, 1)):
        ref = grouped_gemm_triton(a, plain, counts, a_values=a_vals, config=cfg)
        assert torch.equal(grouped_gemm_triton(a, ordered, counts, a_values=a_vals, config=cfg), ref), vars(cfg)
    bytes_only = stack_expert_weights(ws, decode=True)
    bytes_only.decode_scale = None  # the decode order with the E4M3 bytes decoded in the loop
    assert torch.equal(ordered.decode_scale, decode_scales(plain.scale))
    for cfg in (GemmConfig(16, 32, 128, 4, 1, swap_ab=True), GemmConfig(16, 32, 256, 4, 1)):
        ref = grouped_gemm_triton(a, plain, counts, a_values=a_vals, config=cfg)
        assert torch.equal(grouped_gemm_triton(a, bytes_only, counts, a_values=a_vals, config=cfg), ref), vars(cfg)
    doubled = stack_expert_weights(ws, decode=True)
    doubled.decode_scale = doubled.decode_scale * 2  # the fp16 scales are what the kernel reads: the test can fail
    tile = GemmConfig(16, 32, 128, 4, 1)
    assert not torch.equal(grouped_gemm_triton(a, doubled, counts, a_values=a_vals, config=tile),
                           grouped_gemm_triton(a, plain, counts, a_values=a_vals, config=tile))
    # every scale byte through a launch (0x7F, E4M3's NaN, and the sign bit included), fp16 against the loop's decode
    every = stack_expert_weights([_weights(64, 512, 40 + e) for e in range(experts)], decode=True)
    assert every.scale.numel() >= 256
    every.scale = (torch.arange(every.scale.numel()) % 256).to(torch.uint8).reshape(every.scale.shape).to(DEVICE)
    every.decode_scale = decode_scales(every.scale.view(torch.float8_e4m3fn))
    ae, ae_vals = quantize_with_values_triton(torch.randn(sum(counts), 512, device=DEVICE), (1, 16), "row", "nearest",
                                              None, False)
    assert torch.equal(grouped_gemm_triton(ae, every, counts, a_values=ae_vals, config=tile),
                       grouped_gemm_triton(ae, dataclasses.replace(every, decode_scale=None), counts, a_values=ae_vals,
                                           config=tile))
    # K = 384 with 256-wide K steps: the masked (not EVEN_K) loads of the decode order, both scale paths
    ws3 = [_weights(n, 384, 30 + e) for e in range(experts)]
    ordered3 = stack_expert_weights(ws3, decode=True)
    a3, a3_vals = quantize_with_values_triton(torch.randn(sum(counts), 384, device=DEVICE), (1, 16), "row", "nearest",
                                              None, False)
    ref3 = grouped_gemm_triton(a3, stack_expert_weights(ws3), counts, a_values=a3_vals,
                               config=GemmConfig(16, 32, 64, 4, 1))
    for w3 in (ordered3, dataclasses.replace(ordered3, decode_scale=None)):
        assert torch.equal(grouped_gemm_triton(a3, w3, counts, a_values=a3_vals, config=GemmConfig(16, 32, 256, 4, 1)),
                           ref3)
    garbled = stack_expert_weights(ws, decode=True)
    garbled.decode_data = plain.data  # the plain order read as the decode order: the test can fail
    assert not torch.equal(grouped_gemm_triton(a, garbled, counts, a_values=a_vals, config=GemmConfig(16, 32, 128, 4, 1)),
                           grouped_gemm_triton(a, plain, counts, a_values=a_vals, config=GemmConfig(16, 32, 128, 4, 1)))
    with pytest.raises(ValueError, match="multiple of 128"):
        decode_order(torch.zeros(4, 40, dtype=torch.uint8))


def test_dense_gemm_takes_its_row_count_as_an_argument():
    """gemm_triton runs the grouped kernel with one group whose row count is a kernel argument (SINGLE: no counts
    tensor, no launch to fill one): the same bits as that group's counts given as a tensor, at several M and tiles;
    a None count with more than one expert's weights is refused."""
    from minite.kernels.nvfp4_gemm import stack_expert_weights
    b = _q(torch.randn(48, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE), block=(16, 16), scope="tensor")
    w = stack_expert_weights([b])
    for m, cfg in itertools.product((1, 17, 40), (None, GemmConfig(16, 32, 64, 4, 1, swap_ab=True))):
        a = _q(torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(DEVICE))
        counts = torch.tensor([m], dtype=torch.int32, device=DEVICE)
        want = grouped_gemm_triton(a, w, counts, torch.float32, config=cfg)
        assert torch.equal(grouped_gemm_triton(a, w, None, torch.float32, config=cfg), want)
        if cfg is None:
            assert torch.equal(gemm_triton(a, b), want)
    with pytest.raises(ValueError, match="one expert's weights"):
        grouped_gemm_triton(a, stack_expert_weights([b, b]), None)
