"""minite.strict.fused_combine: combine_fixed_order's sums in one Triton kernel, bit for bit (the interpreter on the
CPU, compiled on a GPU: the same tests)."""
import pytest
import torch

from minite.ops import combine_fixed_order, combine_scatter_add
from minite.strict import fused, fused_combine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, k, hidden, dtype, seed):
    """Rows grouped by expert as the dispatcher makes them (expert-major, ascending token), values at mixed
    magnitudes so that the order of the sums shows, -0.0 rows, an inf and a NaN."""
    g = torch.Generator().manual_seed(seed)
    experts = max(k, 6)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    row_token = torch.arange(tokens).repeat_interleave(k)[torch.sort(ids.reshape(-1), stable=True).indices]
    rows = (torch.randn(tokens * k, hidden, generator=g) * torch.logspace(-6, 6, hidden)).to(dtype)
    rows[0] = -0.0
    if tokens * k > 3:
        rows[3, 1] = float("inf")
        rows[2, 2] = float("nan")
    return rows.to(DEVICE), row_token.to(DEVICE)


def _torch_ops(rows, row_token, tokens, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(fused, "PROVEN", fused.PROVEN - {"combine"})
        return combine_fixed_order(rows, row_token, tokens)


def _same(a, b):
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return bool(((a.view(bits) == b.view(bits)) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("tokens,k,hidden", [(64, 8, 2048), (1, 8, 100), (7, 2, 600), (256, 8, 64), (5, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_combine_is_bitwise_the_torch_ops(tokens, k, hidden, dtype, monkeypatch):
    rows, row_token = _case(tokens, k, hidden, dtype, tokens * k + hidden)
    want = _torch_ops(rows, row_token, tokens, monkeypatch)
    got = fused_combine.combine(rows, row_token, tokens)
    assert got.dtype == torch.float32 and _same(got, want)


def test_routes_only_decode_sized_calls():
    rows = torch.zeros(fused_combine.MAX_ROWS + 8, 4)
    assert not fused_combine.applies(rows, torch.zeros(rows.shape[0], dtype=torch.long), 8)
    assert not fused_combine.applies(torch.zeros(10, 4), torch.zeros(10, dtype=torch.long), 3)  # not k per token
    with pytest.raises(ValueError, match="strict fused combine needs"):
        fused_combine.combine(torch.zeros(10, 4), torch.zeros(10, dtype=torch.long), 3)


@pytest.mark.parametrize("tokens,k,hidden", [(64, 8, 2048), (1, 8, 100), (7, 2, 600), (5, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_combine_is_bitwise_the_cpu_scatter_add(tokens, k, hidden, dtype):
    """The default combine's kernel (`combine_in_rows_dtype`) gives torch's CPU scatter_add bits: fp32 sums from 0
    (a -0.0 row becomes +0.0), rounded once to the rows' dtype; on a GPU, the compiled kernel against the CPU's."""
    rows, row_token = _case(tokens, k, hidden, dtype, 7 * tokens + k + hidden)
    # subnormal rows and sums in the first columns (the interpreter's fp32 -> bf16 cast mishandles those)
    tiny = torch.randn(rows.shape[0], 4, generator=torch.Generator().manual_seed(k)) * torch.finfo(dtype).tiny / 3
    rows[:, 4:8] = tiny.to(dtype).to(rows.device)
    want = combine_scatter_add(rows.cpu(), row_token.cpu(), tokens)  # torch's ops on the CPU: nothing routes there
    assert (want[:, 4:8] != 0).any()
    got = fused_combine.combine_in_rows_dtype(rows, row_token, tokens)
    assert got.dtype == dtype and _same(got.cpu(), want)
    if dtype != torch.float32 and k > 2:  # one rounding, not one per addition (the same for two rows)
        per_add = torch.zeros(tokens, hidden, dtype=dtype)
        for r in range(rows.shape[0]):
            per_add[row_token[r]] = per_add[row_token[r]] + rows[r].cpu()
        assert not _same(per_add, want)
