"""The launchers' host helpers (minite.kernels._launch): plain-integer grid arithmetic equal to Triton's, and the
direct launch of compiled kernels, which on the GPU must give the bits of Triton's own launch,
also for a misaligned view (another specialisation) and under CUDA-graph capture."""
import pytest
import torch
import triton

from minite.kernels import _launch
from minite.kernels._launch import cdiv, launcher, next_power_of_2, sm_count
from minite.kernels import nvfp4_quant


def test_integer_helpers_equal_tritons():
    for n in list(range(-40, 5000)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_sm_count_off_cuda_is_one():
    assert sm_count(torch.device("cpu")) == 1


def test_launcher_is_tritons_launch_off_the_compiled_path():
    lk = launcher(nvfp4_quant._quant_kernel)
    assert lk is launcher(nvfp4_quant._quant_kernel)
    if not torch.cuda.is_available() or triton.__version__.split(".")[:2] != ["3", "6"]:
        assert not lk.fast  # the interpreter, or a Triton the direct launch was not built for


gpu = pytest.mark.skipif(not torch.cuda.is_available() or triton.__version__.split(".")[:2] != ["3", "6"]
                         or not _launch._fast_launch_supported(),
                         reason="the direct launch runs on a GPU with Triton 3.6 only")


def _quant(x, rounding="nearest", scope="tensor", rht=False):
    q, vals = nvfp4_quant.quantize_with_values_triton(x, (1, 16), scope, rounding, 7 if rounding != "nearest" else None,
                                                      rht, values_dtype=torch.float16)
    return [q.data, q.scale.view(torch.uint8), q.global_scale, q.amax, vals]


def _standard(fn):
    """fn() with every launcher on Triton's own launch path."""
    saved = {k: lk.fast for k, lk in _launch._LAUNCHERS.items()}
    for lk in _launch._LAUNCHERS.values():
        lk.fast = False
    try:
        return fn()
    finally:
        for k, lk in _launch._LAUNCHERS.items():
            lk.fast = saved.get(k, lk.fast)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("args", [("nearest", "row", False), ("stochastic", "tensor", False),
                                  ("stochastic", "tensor", True), ("nearest", "tensor", True)])
def test_direct_launch_gives_tritons_bits(args):
    torch.manual_seed(0)
    base = torch.randn(512, 1024 + 16, device="cuda", dtype=torch.bfloat16)
    for x in (base[:, :1024], base[:, 8:8 + 1024], base[:, :1024].t()):  # aligned, misaligned (2 B x 8), transposed
        for _ in range(2):  # the second call takes the direct launch
            fast = _quant(x, *args)
        want = _standard(lambda: _quant(x, *args))
        for f, w in zip(fast, want):
            assert torch.equal(f.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
    assert launcher(nvfp4_quant._quant_kernel).fast
    assert len(launcher(nvfp4_quant._quant_kernel).compiled) >= 2  # aligned and misaligned: two specialisations


@pytest.mark.gpu
@gpu
def test_direct_launch_under_cuda_graph_capture():
    torch.manual_seed(1)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        _quant(x, "stochastic")  # the specialisation is kept before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _quant(x, "stochastic")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = _standard(lambda: _quant(x, "stochastic"))
    for f, w in zip(out, want):
        assert torch.equal(f.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
