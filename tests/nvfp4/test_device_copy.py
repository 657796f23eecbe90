"""minite.nvfp4.device_copy: int32_to gives the same int32 values on the target device from a list or a tensor, host_to
any host tensor (a segment table); on a GPU the copy is staged through pinned memory (no stream synchronisation), and
refused under CUDA-graph capture."""
import numpy as np
import pytest
import torch

from minite.nvfp4.device_copy import host_to, int32_to


def test_values_and_dtype_on_cpu():
    for values in ([3, 0, 17], torch.tensor([3, 0, 17], dtype=torch.int64)):
        t = int32_to(values, "cpu")
        assert t.dtype == torch.int32 and t.tolist() == [3, 0, 17]
    table = torch.from_numpy(np.array([[1, -2], [2**40, 7]], dtype=np.int64))
    assert torch.equal(host_to(table, "cpu"), table)


@pytest.mark.gpu
def test_gpu_copy_and_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert int32_to([5, 6], "cuda").tolist() == [5, 6]
    on_gpu = torch.tensor([1, 2], device="cuda")
    assert int32_to(on_gpu, "cuda").dtype == torch.int32
    table = torch.from_numpy(np.arange(14, dtype=np.int64).reshape(2, 7) - 3)
    assert torch.equal(host_to(table, "cuda").cpu(), table)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="under CUDA-graph capture"):
        with torch.cuda.graph(g):  # a replay would read the capture's values: refused
            int32_to([7, 8], "cuda")
    with pytest.raises(RuntimeError, match="under CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            host_to(table, "cuda")
