"""Timing and logging shared by the kernel benchmarks (bench_nvfp4.py and its rollout sections, rollout_gemms.py):
medians of triton.testing.do_bench, CUDA-graph replays, and one log that the JSON keeps."""
from __future__ import annotations

import torch
from triton.testing import do_bench

LOG = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def bench(fn, rep=200) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=50, rep=rep, return_mode="median")


def bench_graph(fn, iters: int) -> float:
    """Median ms per call of `fn` (which does `iters` calls), replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay) / iters
