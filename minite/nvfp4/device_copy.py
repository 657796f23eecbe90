"""Small host -> device copies of index tables (token counts, group offsets) without a stream synchronisation.

CUDA synchronises the stream before a host-to-device copy from pageable memory (cudaMemcpyAsync's documented
behaviour for pageable sources) and refuses such a copy during CUDA-graph capture; torch's `.to(device,
non_blocking=True)` from an ordinary CPU tensor is one. Staged through pinned memory (torch's caching host allocator
keeps the buffer until the copy has run), the copy is asynchronous. Off the GPU this is a plain `.to(device)`: the
values are the same either way. Not for a captured region: a graph would replay the values of the capture, so a
call there raises (code under capture keeps its tables on the device).
"""
from __future__ import annotations

import torch


def host_to(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (e.g. `torch.from_numpy` of a table) on `device`, copied without a sync."""
    if torch.device(device).type != "cuda" or t.is_cuda or not torch.cuda.is_available():
        return t.to(device)  # already there, or no GPU (tests' fake CUDA tensors): an ordinary copy, if any
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a host-to-device table copy under CUDA-graph capture: the graph would replay the captured "
                           "values; keep the table on the device")
    return t.pin_memory().to(device, non_blocking=True)


def int32_to(values, device) -> torch.Tensor:
    """`values` (a list or a CPU tensor of integers) as an int32 tensor on `device`, copied without a sync."""
    return host_to(torch.as_tensor(values, dtype=torch.int32), device)
