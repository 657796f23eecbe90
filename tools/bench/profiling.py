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


def print_sync_sites(fn, top: int, label: str = "", show: bool = True, root: str | None = None) -> int:
    """One call of fn with torch's CUDA sync debug mode on: every host synchronisation (an `.item()`, a `.tolist()`,
    a pageable copy) is counted by the call site nearest to it in this repository (or Megatron-Core), printed as the
    `top` sites with their counts and the Python line that reached torch. Returns the number of synchronisations
    (0 off CUDA, where nothing synchronises). Other warnings are shown as usual and not counted; a synchronisation in
    a C++ autograd node is reported when the engine hands its warnings back, at the `.backward()` call."""
    import collections
    import os
    import traceback
    import warnings

    if not torch.cuda.is_available():
        return 0
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # torch's "called a synchronizing CUDA operation"; others as usual
            return old(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if (f.filename.startswith(root) or "/megatron/" in f.filename) and "/tools/bench/" not in f.filename]
        inner = frames[-1] if frames else None
        where = f"{os.path.relpath(inner.filename, root) if inner.filename.startswith(root) else inner.filename}" \
                f":{inner.lineno} {inner.name}" if inner else f"{filename}:{lineno}"
        sites[where] += 1

    torch.cuda.synchronize()
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    torch.cuda.synchronize()
    total = sum(sites.values())
    if show:
        print(f"== host synchronisations {label}: {total} in all, by call site", flush=True)
        for where, n in sites.most_common(top):
            print(f"{n:6d}  {where}", flush=True)
    return total
