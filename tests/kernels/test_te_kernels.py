"""The Triton kernels (under TRITON_INTERPRET=1 here; compiled in tests/nvfp4/test_te_reference_gpu.py) against
Transformer Engine's formulas (tests/nvfp4/te_reference.py), bit for bit.

Quantisation: every configuration of tests/nvfp4/test_te_reference.py on 32 x 256 = 8,192 elements (the
interpreter is slow). GEMMs: inputs whose fp32 accumulation is exact (te_reference.flat_block_inputs), so the dense,
grouped and segmented (wgrad) kernels must reproduce TE's alpha epilogue bit for bit.
"""
import itertools

import pytest
import torch

from minite.kernels.nvfp4_gemm import gemm_triton, grouped_gemm_triton
from minite.kernels.nvfp4_quant import quantize_triton
from minite.nvfp4 import NVFP4Stack, quantize_column_segments, segmented_gemm

from tests.nvfp4.te_reference import flat_block_inputs, make_inputs, te_gemm, te_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [((1, 16), "tensor", False), ((16, 16), "tensor", False), ((1, 16), "row", False),
           ((1, 16), "tensor", True), ((1, 16), "row", True)]


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("cfg,dtype", list(itertools.product(CONFIGS, [torch.float32, torch.bfloat16])),
                         ids=lambda v: str(v))
def test_triton_quantize_equals_te(cfg, dtype):
    block, scope, rht = cfg
    x = make_inputs(32, 256, dtype, seed=11)
    q = quantize_triton(x.to(DEVICE), block, scope, "nearest", None, rht)
    codes, scale, amax, s_dec = te_quantize(x, tile=block, row_scaled=scope == "row", rht=rht)
    assert torch.equal(q.codes().cpu(), codes)
    assert torch.equal(q.scale.view(torch.uint8).cpu(), scale.view(torch.uint8))
    assert torch.equal(_bits(q.amax.cpu()), _bits(amax))
    live = amax > 0
    assert torch.equal(_bits(q.global_scale.cpu()[live]), _bits(s_dec[live]))


def _te(x, tile=(1, 16), row=False):
    c, s, a, _ = te_quantize(x, tile=tile, row_scaled=row)
    return c, s, a


def test_triton_dense_and_grouped_gemm_equal_te_alpha():
    x = flat_block_inputs(48, 128, 1, True, seed=1)
    ws = [flat_block_inputs(32, 128, 16, False, seed=2 + e) for e in range(3)]
    qa = quantize_triton(x.to(DEVICE), (1, 16), "row", "nearest", None, False)
    qws = [quantize_triton(w.to(DEVICE), (16, 16), "tensor", "nearest", None, False) for w in ws]
    ca, sa, aa = _te(x, row=True)
    want = [te_gemm(ca, sa, aa, *_te(w, (16, 16)), b_tile_rows=16) for w in ws]
    assert torch.equal(_bits(gemm_triton(qa, qws[0]).cpu()), _bits(want[0]))
    counts = [16, 0, 32]
    out = grouped_gemm_triton(qa, NVFP4Stack.from_tensors(qws), counts).cpu()
    assert torch.equal(_bits(out[:16]), _bits(want[0][:16]))
    assert torch.equal(_bits(out[16:]), _bits(want[2][16:]))


def test_triton_segmented_wgrad_gemm_equals_te_alpha():
    widths = [32, 0, 64]
    a = torch.cat([flat_block_inputs(16, w, 1, False, seed=20 + i) for i, w in enumerate(widths) if w], dim=1)
    b = torch.cat([flat_block_inputs(32, w, 1, False, seed=30 + i) for i, w in enumerate(widths) if w], dim=1)
    qa = quantize_column_segments(a.to(DEVICE), widths, backend="triton")
    qb = quantize_column_segments(b.to(DEVICE), widths, backend="triton")
    out = segmented_gemm(qa, qb, backend="triton").cpu()
    start = 0
    for e, w in enumerate(widths):
        if w:
            want = te_gemm(*_te(a[:, start:start + w]), *_te(b[:, start:start + w]))
            assert torch.equal(_bits(out[e]), _bits(want)), e
        start += w
    assert torch.equal(out[1], torch.zeros(16, 32))
