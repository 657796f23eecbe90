"""minite.strict.fused_linear: ops._linear_fwd's products and tree over K in one Triton kernel, bit for bit (the
interpreter on the CPU; the GPU test is in tests/alignment/test_strict_alignment_gpu.py)."""
import math

import pytest
import torch

from minite.strict import fused, fused_linear, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, w, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(fused, "PROVEN", fused.PROVEN - {"linear", "tree_sum"})  # the torch ops
        return ops._linear_fwd(x, w)


def _same(a, b):
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("k", [1, 2, 48, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_linear_is_bitwise_ops_linear(k, dtype, monkeypatch):
    """Random rows at mixed magnitudes (sums that cancel), K a power of two or not (zero padding), K = 1 (no
    addition), inf, NaN, -0.0 and subnormal operands; a row alone equals the same row in the batch."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=g) * torch.logspace(-4, 4, k)).to(dtype)
    w = torch.randn(9, k, generator=g).to(dtype)
    x[1, 0], x[2, -1], x[3, k // 2] = math.inf, math.nan, -0.0
    w[4, 0], w[5, -1] = 1e-40 if dtype == torch.float32 else 1e-7, -0.0
    x, w = x.to(DEVICE), w.to(DEVICE)
    ref = _reference(x, w, monkeypatch)
    got = fused_linear.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (5, 9) and _same(got, ref)
    assert torch.equal(fused_linear.linear(x[4:5], w), got[4:5])


def test_fused_linear_router_shape_and_mixed_dtypes(monkeypatch):
    """The strict router's call (fp32 hidden states x fp32 router weight, K = 2048, N = 128 experts: several column
    blocks per row) and bf16 x against fp32 w."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2048, generator=g).to(DEVICE)
    w = (torch.randn(128, 2048, generator=g) * 0.02).to(DEVICE)
    assert _same(fused_linear.linear(x, w), _reference(x, w, monkeypatch))
    xb = x.bfloat16()
    assert _same(fused_linear.linear(xb, w), _reference(xb, w, monkeypatch))


@pytest.mark.parametrize("m", [5, 8, 13])
def test_rows_sharing_a_weight_block_give_each_rows_bits(m, monkeypatch):
    """Up to 8 rows a program (the weight block loaded once, `_rows`; a batch of 256 on the GPU), the last program's
    rows past m masked: every row's bits as ops._linear_fwd's and as the row alone."""
    monkeypatch.setattr(fused_linear, "MIN_PROGRAMS", 1)
    assert fused_linear._rows(m, 2) == min(8, 1 << (m.bit_length() - 1)) and fused_linear._rows(1, 2) == 1
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 300, generator=g) * torch.logspace(-3, 3, 300)).to(DEVICE)
    w = torch.randn(20, 300, generator=g).to(DEVICE)
    x[m - 1, 7] = math.nan
    got = fused_linear.linear(x, w)
    assert _same(got, _reference(x, w, monkeypatch))
    for r in (0, m - 1):
        assert torch.equal(fused_linear.linear(x[r:r + 1], w).view(torch.int32), got[r:r + 1].view(torch.int32))


def test_rows_a_program_keep_the_launch_wide():
    """Rows share a program only while MIN_PROGRAMS programs remain: the decode batches of the strict router (128
    experts at K = 2048: 32 column blocks)."""
    assert [fused_linear._rows(m, 32) for m in (1, 8, 32, 64, 128, 256, 4096)] == [1, 1, 1, 2, 4, 8, 8]


def test_fused_linear_edges_and_errors():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    assert fused_linear.linear(x[:0], w).shape == (0, 3)
    assert torch.equal(fused_linear.linear(x[:, :0], w[:, :0]), torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="strict fused linear"):
        fused_linear.linear(x, w[:, :4])
    with pytest.raises(ValueError, match="float64"):
        fused_linear.linear(x.double(), w)
    with pytest.raises(ValueError, match="at most"):
        fused_linear.linear(torch.randn(1, 4096, device=DEVICE), torch.randn(1, 4096, device=DEVICE))
    assert fused_linear.applies(262140, 2048) and not fused_linear.applies(262141, 2048)  # 65,535 column blocks
    assert fused_linear.applies(10 ** 6, 16) and fused_linear.applies(5, 0)


def test_linear_is_routed_only_while_proven(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_linear, "linear", lambda x, w: calls.append(1) or torch.zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    x, w = torch.randn(2, 8), torch.randn(3, 8)  # CPU tensors: no other kernel may be routed ("linear" alone)
    monkeypatch.setattr(fused, "PROVEN", {"linear"})
    ops.linear(x, w)
    assert calls == [1]
    ops.linear(x.double(), w.double())  # float64: the torch ops
    ops.linear(torch.randn(2, 4096), torch.randn(3, 4096))  # K past MAX_WIDTH: the torch ops
    monkeypatch.setattr(fused_linear, "MAX_COLUMN_BLOCKS", 1)
    ops.linear(x, torch.randn(2000, 8))  # two column blocks of 1,024, more than the grid takes: the torch ops
    assert calls == [1]
    monkeypatch.setattr(fused, "PROVEN", set())
    ops.linear(x, w)
    assert calls == [1]  # a kernel out of PROVEN is not routed
