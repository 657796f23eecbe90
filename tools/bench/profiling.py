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


def print_op_sites(fn, ops: list[str], top: int, label: str = "", show: bool = True,
                   root: str | None = None) -> dict:
    """One call of fn under torch.profiler with Python stacks: each op named in `ops` (e.g. aten::copy_) counted by
    the function nearest to it in this repository or Megatron-Core (named by file and first line: torch's Python
    events carry no current line), tagged with the built-in autograd node that ran it if any, with its device time
    (kernels launched under it; host time off CUDA). Answers "whose copies are these" where the op table only says
    how many. Returns {site: (calls, time_us)}."""
    import collections
    import os

    from torch.profiler import ProfilerActivity, profile

    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    sites: dict = collections.defaultdict(lambda: [0, 0.0])
    packages = tuple(f"{d}/" for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) + ("megatron/",)
    wanted = set(ops)
    for evt in prof.events():
        if evt.name not in wanted or evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        if any(p.name in wanted for p in _parents(evt)):  # a copy_ inside a counted _to_copy: counted once
            continue
        chain = (evt.stack or []) + [q.name for q in _parents(evt)]  # stacks: older torch; parent events: newer
        frames = [f for f in chain if _ours(f, root, packages)]
        node = next((f.split(": ", 1)[1] for f in chain if f.startswith("autograd::engine::evaluate_function: ")), "")
        where = (frames[0].replace(root + "/", "") if frames else "(no Python frame of ours)") + \
            (f" [autograd {node}]" if node else "")
        s = sites[f"{evt.name} {where}"]
        s[0] += 1
        s[1] += evt.device_time_total if cuda else evt.cpu_time_total
    if show:
        unit = "device" if cuda else "host"
        total = sum(t for _, t in sites.values())
        print(f"== op sites {label}: {', '.join(ops)}; {total / 1e3:.1f} ms {unit} time in all, by call site", flush=True)
        for where, (n, t) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"{t / 1e3:9.2f} ms {n:6d}  {where}", flush=True)
    return {k: tuple(v) for k, v in sites.items()}


def _parents(evt):
    p = evt.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _ours(frame: str, root: str, packages: tuple) -> bool:
    """A Python frame event ("path(line): name", the path relative to sys.path where it can be) of this repository's
    code or Megatron-Core's, the benchmarks' own frames excepted."""
    path = frame.split("(", 1)[0]
    return path.endswith(".py") and "tools/bench/" not in path and (path.startswith(root) or path.startswith(packages))
