"""One call of a function under torch.profiler, its `top` ops printed by self device time and by self host time:
where a benchmark's time goes (`--profile TOP` of bench_learner_slice.py, bench_weight_sync.py, bench_rollout.py)."""
from __future__ import annotations

import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


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
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        span, busy = busy_span(kernels)
        print(f"== profile {label}: {len(kernels)} device events, span {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, "
              f"idle {(span - busy) / 1e3:.1f} ms", flush=True)
    print(f"== profile {label}: top {top} ops by self device time, then by self host time", flush=True)
    print(ka.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                   max_name_column_width=60), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60), flush=True)


def busy_span(intervals) -> tuple[float, float]:
    """(first start to last end, length of the union) of [start, end) intervals: a profiled step's device span and
    the time some kernel ran in it; span - busy is the time the GPU sat idle inside the step (waiting for the host)."""
    ordered = sorted(intervals)
    if not ordered:
        return 0.0, 0.0
    busy, (cur_s, cur_e) = 0.0, ordered[0]
    for s, e in ordered[1:]:
        if s > cur_e:  # a gap: the merged interval before it is done
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    return cur_e - ordered[0][0], busy + cur_e - cur_s


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


# torch's warning at each synchronising operation in sync debug mode ("warn"). Match it exactly: the mode's first
# setting in a process also warns, once, that the mode "does not yet detect all synchronizing operations", which a
# match on "synchroniz" counted as one synchronisation (the -0.2 host syncs a step of some rollout rows, and a failure
# of the RL micro-batch test run alone; docs/benchmarks.md, the thirty-second session).
SYNC_WARNING = "called a synchronizing CUDA operation"


def print_sync_sites(fn, top: int, label: str = "", show: bool = True, root: str | None = None) -> int:
    """One call of fn with torch's CUDA sync debug mode on: every host synchronisation (an `.item()`, a `.tolist()`,
    a pageable copy) is counted by the call site nearest to it in this repository (or Megatron-Core), printed as the
    `top` sites with their counts and the Python line that reached torch. Returns the number of synchronisations
    (0 off CUDA, where nothing synchronises). Other warnings are shown as usual and not counted; a synchronisation in
    a C++ autograd node is reported when the engine hands its warnings back, at the `.backward()` call."""
    import collections
    import traceback
    import warnings

    if not torch.cuda.is_available():
        return 0
    root = root or ROOT
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):  # a synchronisation; other warnings as usual
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
    """One call of fn under a TorchDispatchMode: each aten op named in `ops` (e.g. aten::copy_) counted by the line
    of this repository or Megatron-Core nearest to it on the Python stack (its thread's: on CUDA a built-in autograd
    node's op in the backward has none) and the autograd node that ran it in the backward, with the bytes it wrote
    and its time (CUDA events around it; host time off CUDA). Answers "whose copies are these" where the op table
    only says how many. The mode sees every op after autograd, on the engine's threads too, whatever torch's
    profiler records. Returns {site: (calls, bytes, time_us)}."""
    import collections
    import time
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    root = root or ROOT
    cuda = torch.cuda.is_available()
    wanted = set(ops)
    calls: list = []  # (site, bytes, start event or seconds, end event or seconds)

    def site() -> str:
        frames = [f for f in traceback.extract_stack()[:-3] if _ours(f.filename, root)]
        node = torch._C._current_autograd_node()
        where = f"{_short(frames[-1].filename, root)}:{frames[-1].lineno} {frames[-1].name}" if frames else \
            "(no Python frame of ours)"
        return where + (f" [autograd {node.name()}]" if node is not None else "")

    class Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name not in wanted:
                return func(*args, **(kwargs or {}))
            if cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
            else:
                t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if cuda:
                t1.record()
            else:
                t1 = time.perf_counter()
            nbytes = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
            calls.append((f"{func._schema.name} {site()}", nbytes, t0, t1))
            return out

    if cuda:
        torch.cuda.synchronize()
    with Sites():
        fn()
    if cuda:
        torch.cuda.synchronize()
    sites: dict = collections.defaultdict(lambda: [0, 0, 0.0])
    for where, nbytes, t0, t1 in calls:
        s = sites[where]
        s[0] += 1
        s[1] += nbytes
        s[2] += t0.elapsed_time(t1) * 1e3 if cuda else (t1 - t0) * 1e6
    if show:
        unit = "device" if cuda else "host"
        total = sum(t for _, _, t in sites.values())
        print(f"== op sites {label}: {', '.join(ops)}; {len(calls)} calls, {total / 1e3:.1f} ms {unit} time in all "
              f"(each op between two events), by call site", flush=True)
        for where, (n, b, t) in sorted(sites.items(), key=lambda kv: -kv[1][2])[:top]:
            print(f"{t / 1e3:9.2f} ms {n:6d} calls {b / 2**20:10.1f} MiB  {where}", flush=True)
    return {k: tuple(v) for k, v in sites.items()}


def _ours(path: str, root: str) -> bool:
    """A file of this repository (the benchmarks' own excepted) or of Megatron-Core."""
    if "/site-packages/" in path or "/dist-packages/" in path:  # a venv inside the tree is not ours
        return "/megatron/core/" in path
    return path.startswith(root) and "/tools/bench/" not in path


def _short(path: str, root: str) -> str:
    return os.path.relpath(path, root) if path.startswith(root) else path[path.index("megatron/core/"):]


def print_phases(fn, targets: list, label: str = "", show: bool = True) -> list:
    """One call of fn with each (object, attribute name, phase label) of `targets` wrapped in a device-synchronised
    timer: the call's timeline of phases in order, and the time between them (e.g. a micro-batch's backward between
    its forward and the next one), printed as ms. A phase that calls another is timed whole, its inner phases too.
    Returns [(label, start s, end s)] relative to the call's start."""
    import time

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    spans: list = []
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]

    def timed(inner, phase):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                sync()
                spans.append((phase, t - t0, time.perf_counter() - t0))
        return wrapper

    for (obj, name, phase), (_, _, inner) in zip(targets, saved):
        setattr(obj, name, timed(inner, phase))
    sync()
    t0 = time.perf_counter()
    try:
        fn()
        sync()
    finally:
        total = time.perf_counter() - t0
        for obj, name, inner in reversed(saved):
            setattr(obj, name, inner)
    if show:
        print(f"== phases {label}: {total * 1e3:.1f} ms in all (device-synchronised at each phase)", flush=True)
        end = 0.0
        for phase, s, e in sorted(spans, key=lambda x: x[1]):
            if s - end > 5e-4:
                print(f"{(s - end) * 1e3:9.2f} ms  (between)", flush=True)
            print(f"{(e - s) * 1e3:9.2f} ms  {phase}", flush=True)
            end = max(end, e)
        if total - end > 5e-4:
            print(f"{(total - end) * 1e3:9.2f} ms  (between)", flush=True)
    return spans
