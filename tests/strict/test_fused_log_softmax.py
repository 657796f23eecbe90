"""minite.strict.fused_log_softmax: the strict log-softmax at one index per row in three Triton launches, bit for bit
the torch ops of minite.strict.ops (the interpreter on the CPU, compiled on a GPU: the same tests)."""
import pytest
import torch

from minite.strict import fused, fused_log_softmax
from minite.strict import ops as S

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, idx, monkeypatch):
    """ops.log_softmax gathered at idx, on the torch ops alone (no fused kernel routed)."""
    with monkeypatch.context() as mp:
        mp.setattr(fused, "PROVEN", set())
        return S.log_softmax(x, -1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _same(a, b):
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())


def _rows(rows, width, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.linspace(0.5, 8.0, rows)[:, None]
    idx = torch.randint(0, width, (rows,), generator=g)
    idx[0] = int(x[0].argmax())  # the largest term, and the one whose log-prob is nearest 0
    return x.to(dtype).to(DEVICE), idx.to(DEVICE)


# widths: one element, below / at / just past one block, several blocks with a partial last one, and (on the GPU)
# the rollout slice's vocabulary (~6 s under the interpreter)
WIDTHS = [1, 2, 7, 1024, 1025, 3000, 151936]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_log_softmax_is_bitwise_the_torch_ops(width, dtype, monkeypatch):
    x, idx = _rows(5, width, width, dtype)
    got = fused_log_softmax.token_log_softmax(x, idx)
    want = _reference(x.float(), idx, monkeypatch)
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert _same(got, want), (got - want).abs().max()
    assert torch.isfinite(got).all() and (got <= 0).all()


def test_special_values_give_the_torch_ops_bits(monkeypatch):
    width = 2100  # three blocks
    x, idx = _rows(8, width, 3)
    x[1, 1500] = float("nan")  # NaN in another block than idx: the whole row is NaN
    x[2, 7] = float("inf")  # +inf: inf - inf is NaN
    x[3, :] = float("-inf")  # every term -inf: -inf - -inf is NaN
    x[4, ::2] = float("-inf")  # some -inf terms: exp gives +0.0
    idx[4] = 0  # the log-prob of a -inf logit: -inf
    x[5] = -200.0  # exp(x - max) of every other term underflows...
    x[5, 10] = 0.0  # ...so the sum is exactly 1 and the log-prob of the max is 0
    idx[5] = 10
    x[6] = x[6] * 1e30  # huge spread
    x[7, 1100] = 90.0  # a large maximum in the middle block
    got = fused_log_softmax.token_log_softmax(x, idx)
    want = _reference(x, idx, monkeypatch)
    assert _same(got, want), (got, want)
    assert torch.isnan(got[1:4]).all() and got[4] == float("-inf") and got[5] == 0.0


def test_an_index_outside_the_row_gives_nan():
    x, idx = _rows(3, 50, 4)
    idx[1], idx[2] = -1, 50
    got = fused_log_softmax.token_log_softmax(x, idx)
    assert torch.isfinite(got[0]) and torch.isnan(got[1:]).all()


def test_ops_token_log_softmax_routes_and_refuses(monkeypatch):
    x, idx = _rows(4, 300, 5)
    want = _reference(x, idx, monkeypatch)
    assert _same(S.token_log_softmax(x, idx), want)  # routed on a GPU (when proven), the torch ops on the CPU
    assert fused.routes(x, kernel="log_softmax") == (DEVICE == "cuda" and "log_softmax" in fused.PROVEN)
    assert not fused_log_softmax.applies(x, idx.to(torch.int32))
    assert not fused_log_softmax.applies(x[0], idx[:1])
    with pytest.raises(ValueError, match="strict fused token_log_softmax needs"):
        fused_log_softmax.token_log_softmax(x, idx[:2])
    xg = x.clone().requires_grad_(True)  # a gradient to record: the torch ops, which have a backward
    out = S.token_log_softmax(xg, idx)
    out.sum().backward()
    assert _same(out.detach(), want) and xg.grad is not None
