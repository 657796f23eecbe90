"""NVFP4 Triton kernels on the H200 at real shapes: quantisation bitwise vs the reference, GEMMs within the
tensor-core accumulation bound, and bitwise batch invariance (M=1 vs 512 vs 16k rows; decode vs dense vs grouped)."""
import dataclasses
import itertools

import pytest
import torch

from minite.nvfp4 import gemm_reference, quantize_reference, row_slice
from minite.nvfp4.tensor import FACTOR_INV
from minite.kernels.nvfp4_gemm import (GemmConfig, gemm_triton, grouped_gemm_triton,
                                       stack_expert_weights)
from minite.kernels.nvfp4_wgrad import kgrouped_gemm_triton
from minite.kernels.nvfp4_quant import quantize_triton, quantize_with_values_triton
from tests.tolerances import TOLERANCES

pytestmark = pytest.mark.gpu
ATOL = TOLERANCES["nvfp4_gemm_tensorcore_acc"][0]
TINY = TOLERANCES["fp32_subnormal_floor"][0]
HIDDEN, FFN2 = 2048, 1536  # Qwen3-30B-A3B expert FC1: 2048 -> 2 * 768
TRAIN = GemmConfig(128, 128, 64, 8, 4)
DECODE_CONFIGS = [GemmConfig(16, 64, 256, 4, 4), GemmConfig(16, 32, 128, 4, 4), GemmConfig(64, 64, 128, 4, 4),
                  GemmConfig(16, 64, 128, 4, 4, swap_ab=True), GemmConfig(16, 128, 128, 4, 4, swap_ab=True)]
CONFIGS = [c for c in itertools.product([(1, 16), (16, 16)], ["tensor", "row"], ["nearest", "stochastic"],
                                        [False, True]) if not (c[1] == "row" and c[0] == (16, 16))]


def _q_act(x):
    return quantize_triton(x, (1, 16), "row", "nearest", None, False)


def _weight(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_triton(torch.randn(n, k, device="cuda", generator=g), (16, 16), "tensor", "nearest", None, False)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0][0]}x16-{c[1]}-{c[2]}-{'rht' if c[3] else 'plain'}")
def test_quantize_bitwise_real_shape(cfg):
    block, scope, rounding, rht = cfg
    torch.manual_seed(0)
    x = (torch.randn(4096, HIDDEN, device="cuda") * torch.logspace(-4, 4, HIDDEN, device="cuda")).bfloat16()
    x[0] = 0
    ref = quantize_reference(x, block=block, scale_scope=scope, rounding=rounding, seed=99, rht=rht)
    assert quantize_triton(x, block, scope, rounding, 99, rht).equal(ref)


def test_quantize_columnwise_wgrad_operand_bitwise():
    torch.manual_seed(1)
    x = torch.randn(8192, HIDDEN, device="cuda").bfloat16()
    ref = quantize_reference(x.t().contiguous(), block=(1, 16), scale_scope="tensor", rounding="stochastic",
                             seed=5, rht=True)
    q, vals = quantize_with_values_triton(x.t(), (1, 16), "tensor", "stochastic", 5, True)
    assert q.equal(ref) and torch.equal(vals, ref.block_values(torch.float16))


def test_gemm_within_tensorcore_bound():
    torch.manual_seed(2)
    a = _q_act(torch.randn(512, HIDDEN, device="cuda").bfloat16())
    b = _weight(FFN2, HIDDEN, 2)
    out = gemm_triton(a, b, config=TRAIN)
    ref = gemm_reference(a, b)
    bound = (a.block_values(torch.float64).abs() @ b.block_values(torch.float64).abs().t()) \
        * ((a.amax[:, None] * b.amax) * FACTOR_INV).double().abs()
    assert torch.all((out.double() - ref.double()).abs() <= ATOL * bound + TINY)


def test_dense_batch_invariance_1_vs_512_vs_16k():
    """The whole W4A4 step (per-row quantisation + GEMM) gives a token the same bits at M=1, 512 and 16384."""
    torch.manual_seed(3)
    x = torch.randn(16384, HIDDEN, device="cuda").bfloat16()
    b = _weight(FFN2, HIDDEN, 3)
    b_vals = b.block_values(torch.float16)
    qa, a_vals = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    big = gemm_triton(qa, b, torch.bfloat16, a_values=a_vals, b_values=b_vals, config=TRAIN)
    mid = gemm_triton(_q_act(x[4096:4608]), b, torch.bfloat16)  # default tiles for 512 rows, packed operands
    assert torch.equal(mid, big[4096:4608])
    for i in (0, 4100, 16383):
        for cfg in DECODE_CONFIGS:
            one = gemm_triton(_q_act(x[i:i + 1]), b, torch.bfloat16, config=cfg)
            assert torch.equal(one, big[i:i + 1]), f"row {i} config {cfg}"
    for m in (4, 16, 32):
        assert torch.equal(gemm_triton(_q_act(x[100:100 + m]), b, torch.bfloat16), big[100:100 + m])


def test_grouped_training_batch_vs_decode_vs_dense():
    """128 experts, 16k permuted tokens: grouped rows == dense rows == decode rows (one token for each of 8 experts)."""
    torch.manual_seed(4)
    experts, tokens = 128, 16384
    counts = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda"), minlength=experts)
    ws = [_weight(FFN2, HIDDEN, 100 + e) for e in range(experts)]
    packed = stack_expert_weights(ws)
    values = stack_expert_weights(ws, values=True)
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    qa, a_vals = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    big = grouped_gemm_triton(qa, values, counts, torch.bfloat16, a_values=a_vals, config=TRAIN)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    e = int(torch.argmax(counts))
    s, c = starts[e], int(counts[e])
    assert torch.equal(gemm_triton(row_slice(qa, s, s + c), ws[e], torch.bfloat16), big[s:s + c])
    chosen = [e2 for e2 in range(0, experts, 16) if counts[e2] > 0][:8]
    rows = [starts[e2] for e2 in chosen]
    sub = stack_expert_weights([ws[e2] for e2 in chosen])
    for cfg in DECODE_CONFIGS:
        dec = grouped_gemm_triton(_q_act(x[rows]), sub, [1] * len(chosen), torch.bfloat16, config=cfg)
        assert torch.equal(dec, big[rows]), f"decode config {cfg}"


@pytest.mark.parametrize("per_expert", [1, 4, 16, 32, 64])
def test_decode_order_weights_equal_the_training_tile(per_expert):
    """Packed weights read as the decode order's words (`stack_expert_weights(decode=True)`; the kernel's inline `mov`
    hands each 32-bit register to Triton as two fp16 elements) give the training tile's bits, for every tile that
    reads that order, with 1 to 64 tokens for each of 8 experts (the default tile for each count included), with the
    scales read as fp16 (`decode_scales`) and as bytes decoded in the loop."""
    torch.manual_seed(5)
    experts, tokens = 64, 8192
    counts = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda"), minlength=experts)
    ws = [_weight(FFN2, HIDDEN, 300 + e) for e in range(experts)]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    qa, a_vals = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    big = grouped_gemm_triton(qa, stack_expert_weights(ws, values=True), counts, torch.bfloat16, a_values=a_vals,
                              config=TRAIN)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    chosen = [e for e in range(experts) if counts[e] >= per_expert][:8]
    assert len(chosen) == 8
    rows = [starts[e] + i for e in chosen for i in range(per_expert)]
    ordered = stack_expert_weights([ws[e] for e in chosen], decode=True)
    assert ordered.decode_data is not None and ordered.decode_scale is not None
    bytes_only = dataclasses.replace(ordered, decode_scale=None)  # the scale bytes decoded in the loop
    xq, x_vals = quantize_with_values_triton(x[rows], (1, 16), "row", "nearest", None, False)
    tiles = [None, GemmConfig(16, 64, 128, 4, 4, swap_ab=True), GemmConfig(32, 64, 128, 4, 4, swap_ab=True),
             GemmConfig(64, 64, 128, 4, 4), GemmConfig(16, 64, 256, 4, 4), GemmConfig(16, 32, 128, 4, 4),
             GemmConfig(16, 128, 128, 4, 4, swap_ab=True), GemmConfig(32, 64, 256, 4, 3, swap_ab=True),
             GemmConfig(32, 128, 128, 4, 3, swap_ab=True), GemmConfig(16, 64, 256, 4, 3, swap_ab=True)]
    for cfg, w in itertools.product(tiles, (ordered, bytes_only)):
        got = grouped_gemm_triton(xq, w, [per_expert] * 8, torch.bfloat16, a_values=x_vals, config=cfg,
                                  rows_hint=per_expert)
        assert torch.equal(got, big[rows]), f"{per_expert} tokens per expert, tile {cfg}, {w.decode_scale is None=}"


def test_wgrad_real_shape_within_bound():
    torch.manual_seed(5)
    counts = [1024, 0, 512, 2048]
    t = sum(counts)
    dy, x = torch.randn(t, FFN2, device="cuda").bfloat16(), torch.randn(t, HIDDEN, device="cuda").bfloat16()
    a, av = quantize_with_values_triton(dy.t(), (1, 16), "tensor", "stochastic", 1, True)
    b, bv = quantize_with_values_triton(x.t(), (1, 16), "tensor", "nearest", None, True)
    out = kgrouped_gemm_triton(a, b, counts, torch.float32, a_values=av, b_values=bv)
    assert torch.equal(out, kgrouped_gemm_triton(a, b, counts, torch.float32))
    s = 0
    for e, c in enumerate(counts):
        ref = (av[:, s:s + c].double() @ bv[:, s:s + c].double().t()) * float((a.amax * b.amax) * FACTOR_INV)
        bound = (av[:, s:s + c].double().abs() @ bv[:, s:s + c].double().abs().t()) \
            * float((a.amax * b.amax) * FACTOR_INV)
        assert torch.all((out[e].double() - ref).abs() <= ATOL * bound + TINY)
        s += c
