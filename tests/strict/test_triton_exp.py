"""minite.strict.triton_exp: ops.exp's float64 operations in one Triton kernel, bit for bit (the interpreter on the
CPU; the GPU test is in tests/alignment/test_strict_alignment_gpu.py)."""
import math

import pytest
import torch

from minite.strict import ops, triton_exp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 88.7, 88.73, 89.0, 89.5, -87.3, -103.9, -104.0, -149.9, -150.0,
                            -150.5, 1e-30, -1e-30, math.inf, -math.inf, math.nan, 3.4e38, -3.4e38], dtype=torch.float64)
    # x * log2(e) near half-integers, where the range reduction picks its integer (either neighbour gives the same
    # fp32 result as long as both sides use the same rule and the same fp64 operations)
    halves = torch.tensor([(k + 0.5) / 1.4426950408889634 for k in range(-20, 20)], dtype=torch.float64)
    x = torch.cat([special, halves, halves.nextafter(halves + 1), halves.nextafter(halves - 1),
                   torch.randn(3000, generator=g, dtype=torch.float64) * 30,
                   torch.empty(2000, dtype=torch.float64).uniform_(-160, 95, generator=g)])
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_exp_is_bitwise_ops_exp(dtype):
    x = _inputs(dtype)
    ref, got = ops.exp(x), triton_exp.exp(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
    assert bool(same.all()), f"{int((~same).sum())} of {x.numel()} differ, first at x={x[~same][0].item()!r}"


def test_fused_exp_shapes_and_strides():
    x = torch.randn(7, 33, device=DEVICE).t()  # non-contiguous
    assert torch.equal(triton_exp.exp(x), ops.exp(x))
    assert triton_exp.exp(torch.empty(0, 3, device=DEVICE)).shape == (0, 3)


def test_ops_exp_routes_to_the_kernel_only_when_enabled_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_exp, "exp", lambda x: calls.append(1) or torch.zeros(x.shape))
    ops.exp(torch.randn(4))
    assert calls == []  # off (the default) and a CPU tensor: the torch ops
    monkeypatch.setattr(triton_exp, "ENABLED", True)
    ops.exp(torch.randn(4))
    assert calls == []  # a CPU tensor stays on the torch ops even when enabled
