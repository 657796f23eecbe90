"""kernels/nvfp4_decode_order.py: packed codes in the decode order in one launch, byte for byte the torch version
of minite.nvfp4.grouped.decode_order (the interpreter on the CPU, compiled on a GPU: the same tests)."""
import pytest
import torch

from minite.kernels.nvfp4_decode_order import decode_order_triton
from minite.nvfp4 import grouped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_order(data):
    """grouped.decode_order's torch ops (the kernel not consulted)."""
    rows = data.reshape(-1, data.shape[-1]).cpu()
    return grouped._words(rows).view(torch.uint8).reshape(data.shape)


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 128), (2, 9, 1024), (4, 3, 192)])
def test_decode_order_kernel_is_bytewise_the_torch_ops(shape):
    g = torch.Generator().manual_seed(sum(shape))
    data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    data.view(-1)[:4] = torch.tensor([0x00, 0xFF, 0x88, 0x77], dtype=torch.uint8)  # zeros, all bits, signs, magnitudes
    got = decode_order_triton(data.to(DEVICE))
    assert got.dtype == torch.uint8 and got.shape == data.shape
    assert torch.equal(got.cpu(), _torch_order(data))


def test_decode_order_dispatches_and_refuses():
    data = torch.randint(0, 256, (2, 3, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(grouped.decode_order(data.to(DEVICE)).cpu(), _torch_order(data))  # the kernel on a GPU
    with pytest.raises(ValueError, match="C % 128 == 0"):
        decode_order_triton(data[..., :96])
    with pytest.raises(ValueError, match="not a multiple of 128"):
        grouped.decode_order(data[..., :96])
