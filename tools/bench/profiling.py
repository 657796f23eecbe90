"""One call of a function under torch.profiler, its `top` ops printed by self device time and by self host time:
where a benchmark's time goes (`--profile TOP` of bench_learner_slice.py, bench_weight_sync.py, bench_rollout.py)."""
from __future__ import annotations

import torch


def print_top(fn, top: int, label: str = "", show: bool = True) -> None:
    """`show` False: run and profile (every rank must, under collectives) but print nothing."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if not show:
        return
    ka = prof.key_averages()
    print(f"== profile {label}: top {top} ops by self device time, then by self host time", flush=True)
    print(ka.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                   max_name_column_width=60), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60), flush=True)


def print_py_top(fn, top: int, label: str = "", show: bool = True) -> None:
    """One call of fn under cProfile (after a device sync): the `top` Python functions by own time, where host time
    goes when a step is launch-bound."""
    import cProfile
    import io
    import pstats

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    if show:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(f"== python profile {label}: top {top} functions by own time", flush=True)
        print(out.getvalue(), flush=True)
