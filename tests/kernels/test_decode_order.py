"""kernels/nvfp4_decode_order.py: packed codes in the decode order in one launch, byte for byte the torch version
of minite.nvfp4.grouped.decode_order (the interpreter on the CPU, compiled on a GPU: the same tests)."""
import pytest
import torch

from minite.kernels.nvfp4_decode_order import decode_order_triton
from minite.nvfp4 import grouped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_order(data, monkeypatch):
    """grouped.decode_order's torch ops (the kernel not consulted), in chunks of 64 rows (its chunking exercised)."""
    monkeypatch.setattr(grouped, "DECODE_CHUNK_BYTES", data.shape[-1])
    with monkeypatch.context() as m:
        m.setattr(grouped, "has_kernel", lambda name: False)
        return grouped.decode_order(data.cpu())


@pytest.mark.parametrize("shape", [(64, 64), (3, 64, 128), (2, 128, 1024), (1, 192, 192)])
def test_decode_order_kernel_is_bytewise_the_torch_ops(shape, monkeypatch):
    g = torch.Generator().manual_seed(sum(shape))
    data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    data.view(-1)[:4] = torch.tensor([0x00, 0xFF, 0x88, 0x77], dtype=torch.uint8)  # zeros, all bits, signs, magnitudes
    got = decode_order_triton(data.to(DEVICE))
    assert got.dtype == torch.uint8 and got.shape == data.shape
    assert torch.equal(got.cpu(), _torch_order(data, monkeypatch))


def test_decode_order_dispatches_and_refuses(monkeypatch):
    data = torch.randint(0, 256, (2, 64, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    want = _torch_order(data, monkeypatch)
    assert torch.equal(grouped.decode_order(data.to(DEVICE)).cpu(), want)  # the kernel on a GPU
    with pytest.raises(ValueError, match="C % 128 == 0"):
        decode_order_triton(data[..., :96])
    with pytest.raises(ValueError, match="R % 64 == 0"):
        decode_order_triton(data[:, :32])
    with pytest.raises(ValueError, match="not a multiple of 128"):
        grouped.decode_order(data[..., :96])
    with pytest.raises(ValueError, match="32 rows is not a multiple of 64"):
        grouped.decode_order(data[:, :32])
