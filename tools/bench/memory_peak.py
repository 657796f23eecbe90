"""What is allocated at a function's CUDA memory peak, by the code that allocated it (`--memory-top N` of
bench_learner_slice.py): torch's allocator history (torch.cuda.memory._record_memory_history, Python stacks) is
recorded around one call, its events are replayed to the moment allocated bytes peak, and the blocks alive then are
summed by their allocation site (the innermost frame in this repository, else in Megatron-Core, else the innermost).
Blocks allocated before the recording started have no site: they are one line, "before the call".
"""
from __future__ import annotations

import torch

OURS = ("/minite/", "/megatron_patches/", "/kernels/", "/tools/bench/")


def site(frames: list) -> str:
    """'file:line function' of the allocation: the innermost frame of ours, else Megatron-Core's, else the first."""
    for marks in (OURS, ("/megatron/core/",)):
        for f in frames:
            if any(m in f["filename"] for m in marks):
                return f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    f = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"


MAX_EVENTS = 2_000_000


def _replay(events: list, before: int, stop: int | None = None):
    """Replay events[:stop] ('alloc' adds a block, 'free_completed' removes it, other actions are ignored) from
    `before` bytes allocated: (alive blocks {addr: (size, frames)}, bytes still alive of those before, peak bytes,
    index of the first event at the peak). A block whose free waits for another stream's use (record_stream) counts
    until its free completes."""
    alive: dict = {}
    pre = total = peak = before
    peak_at = -1
    for i, ev in enumerate(events[:stop]):
        if ev["action"] == "alloc":
            alive[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
        elif ev["action"] == "free_completed":
            if ev["addr"] in alive:
                total -= alive.pop(ev["addr"])[0]
            else:  # a block allocated before the replay
                pre -= ev["size"]
                total -= ev["size"]
        if total > peak:
            peak, peak_at = total, i
    return alive, pre, peak, peak_at


def alive_at_peak(events: list, before: int) -> tuple[int, dict]:
    """(peak bytes, {allocation site: bytes alive at the first moment of the peak}) over allocator `events`
    replayed from `before` bytes allocated; a free of a block allocated before the replay comes out of the
    "before the call" line."""
    peak, peak_at = _replay(events, before)[2:]
    alive, pre, _, _ = _replay(events, before, peak_at + 1)
    at_peak = {"before the call": pre}
    for size, frames in alive.values():
        where = site(frames)
        at_peak[where] = at_peak.get(where, 0) + size
    return peak, at_peak


def print_memory_top(fn, top: int, label: str = "", show: bool = True) -> None:
    """One call of fn with the allocator's history recorded; the `top` allocation sites alive at its peak."""
    if not torch.cuda.is_available():
        print("memory top: no CUDA device, nothing recorded", flush=True)
        return
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snap["device_traces"] for e in trace]
    if len(events) >= MAX_EVENTS:  # the ring buffer dropped the oldest events: the baseline would be wrong
        print(f"memory top: {len(events)} allocator events, the history's limit; the replay is not exact", flush=True)
    peak, at_peak = alive_at_peak(events, before)
    if not show:
        return
    print(f"== memory at the peak of {label}: {peak / 2**30:.3f} GiB ({len(events)} allocator events replayed; "
          f"max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB)", flush=True)
    for where, nbytes in sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {nbytes / 2**20:10.1f} MiB  {where}", flush=True)
