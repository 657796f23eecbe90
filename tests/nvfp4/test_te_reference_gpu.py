"""The compiled Triton kernels on the H200 against Transformer Engine's formulas (tests/nvfp4/te_reference.py), bit
for bit: quantisation of 4096 x 2048 = 8,388,608 elements per configuration and input dtype (random, heavy-tailed
and special values), and the GEMM kernels' TE alpha on inputs with exact fp32 accumulation, for the training and
every decode tile configuration (tests/kernels/test_te_kernels.py is the interpreter version)."""
import itertools

import pytest
import torch

from minite.kernels.nvfp4_gemm import GemmConfig, gemm_triton, grouped_gemm_triton
from minite.kernels.nvfp4_quant import quantize_triton
from minite.nvfp4 import NVFP4Stack, quantize_column_segments, segmented_gemm

from tests.nvfp4.te_reference import flat_block_inputs, make_inputs, te_gemm, te_quantize

pytestmark = pytest.mark.gpu
CONFIGS = [((1, 16), "tensor", False), ((16, 16), "tensor", False), ((1, 16), "row", False),
           ((1, 16), "tensor", True), ((1, 16), "row", True)]
TILES = [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 3), GemmConfig(16, 64, 128, 4, 4, swap_ab=True),
         GemmConfig(32, 64, 128, 4, 4, swap_ab=True), GemmConfig(64, 64, 128, 4, 4)]


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("cfg,dtype", list(itertools.product(CONFIGS, [torch.float32, torch.bfloat16])),
                         ids=lambda v: str(v))
def test_compiled_quantize_equals_te(cfg, dtype):
    block, scope, rht = cfg
    x = make_inputs(4096, 2048, dtype, seed=21)
    q = quantize_triton(x.cuda(), block, scope, "nearest", None, rht)
    codes, scale, amax, s_dec = te_quantize(x, tile=block, row_scaled=scope == "row", rht=rht)
    assert torch.equal(q.codes().cpu(), codes)
    assert torch.equal(q.scale.view(torch.uint8).cpu(), scale.view(torch.uint8))
    assert torch.equal(_bits(q.amax.cpu()), _bits(amax))
    live = amax > 0
    assert torch.equal(_bits(q.global_scale.cpu()[live]), _bits(s_dec[live]))


def _te(x, tile=(1, 16), row=False):
    c, s, a, _ = te_quantize(x, tile=tile, row_scaled=row)
    return c, s, a


@pytest.mark.parametrize("tile", TILES, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}-swap{int(c.swap_ab)}")
def test_compiled_gemms_equal_te_alpha(tile):
    x = flat_block_inputs(512, 256, 1, True, seed=1)
    ws = [flat_block_inputs(1536, 256, 16, False, seed=2 + e) for e in range(4)]
    qa = quantize_triton(x.cuda(), (1, 16), "row", "nearest", None, False)
    qws = [quantize_triton(w.cuda(), (16, 16), "tensor", "nearest", None, False) for w in ws]
    ca, sa, aa = _te(x, row=True)
    want = [te_gemm(ca, sa, aa, *_te(w, (16, 16)), b_tile_rows=16) for w in ws]
    assert torch.equal(_bits(gemm_triton(qa, qws[0], config=tile).cpu()), _bits(want[0]))
    counts = [128, 0, 256, 128]
    out = grouped_gemm_triton(qa, NVFP4Stack.from_tensors(qws), counts, config=tile).cpu()
    starts = [0, 128, 128, 384, 512]
    for e in (0, 2, 3):
        assert torch.equal(_bits(out[starts[e]:starts[e + 1]]), _bits(want[e][starts[e]:starts[e + 1]])), e


def test_compiled_segmented_wgrad_gemm_equals_te_alpha():
    widths = [256, 0, 128, 64]
    a = torch.cat([flat_block_inputs(768, w, 1, False, seed=40 + i) for i, w in enumerate(widths) if w], dim=1)
    b = torch.cat([flat_block_inputs(512, w, 1, False, seed=50 + i) for i, w in enumerate(widths) if w], dim=1)
    qa = quantize_column_segments(a.cuda(), widths, values=True, backend="triton")
    qb = quantize_column_segments(b.cuda(), widths, values=True, backend="triton")
    out = segmented_gemm(qa, qb, backend="triton").cpu()
    start = 0
    for e, w in enumerate(widths):
        if w:
            want = te_gemm(*_te(a[:, start:start + w]), *_te(b[:, start:start + w]))
            assert torch.equal(_bits(out[e]), _bits(want)), e
        start += w
