"""One decode step of the rollout slice kernel by kernel (issue 16): the step's kernels in order with their times and
the gaps between them, and per kernel name the count and total, for the embedded engine's eager steps and its
CUDA-graph replays, NVFP4 (packed experts) and BF16. Where a step's time goes, launch by launch.

    python tools/bench/decode_kernels.py --out /tmp/decode-kernels.json [--batch 64] [--layers 4]

Each engine runs untimed generates of 12 new tokens until its graphs are captured, then one more under torch.profiler
(CUDA activity: a graph's kernels appear one by one). The sampler's pick kernel (kernels/gumbel_sample.py) ends every
step, so the device events between two of them are one decode step; the middle step of the generate is reported.
`span_us` is its first kernel's start to its last kernel's end, `busy_us` the sum of its kernels' times: span - busy is
the time the GPU waited inside the step. The JSON: device, date, commit, command, and per engine ("nvfp4-graphs-b64",
...) kernels, span_us, busy_us, by_name ([name, count, total us], largest first) and sequence ([start us, gap us,
duration us, name] in order). A GPU tool: on the CPU the profiler records no device events.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

STEP_END = "_pick_kernel"
"""The sampler's second launch: the last kernel of every decode step."""


def steps(events: list) -> list:
    """Events (start, end, name) sorted by start, cut into steps: each ends with a STEP_END kernel; what precedes the
    first one (the prefill) and follows the last one is dropped."""
    ends = [i for i, (_, _, name) in enumerate(events) if STEP_END in name]
    return [events[a + 1: b + 1] for a, b in zip(ends, ends[1:])]


def summarise(step: list) -> dict:
    """One step's kernels: count, span, busy time, per-name totals (largest first) and the sequence with gaps."""
    span = step[-1][1] - step[0][0]
    busy = sum(end - start for start, end, _ in step)
    totals = defaultdict(lambda: [0, 0.0])
    sequence, prev = [], step[0][0]
    for start, end, name in step:
        totals[name][0] += 1
        totals[name][1] += end - start
        sequence.append([round(start - step[0][0], 2), round(start - prev, 2), round(end - start, 2), name])
        prev = end
    by_name = sorted(([n, c, round(t, 2)] for n, (c, t) in totals.items()), key=lambda r: -r[2])
    return {"kernels": len(step), "span_us": round(span, 2), "busy_us": round(busy, 2), "by_name": by_name,
            "sequence": sequence}


def profile_engine(engine, prompts: list, new_tokens: int) -> dict | None:
    """The middle decode step of one more generate under the profiler (after untimed ones), or None if no step."""
    from torch.profiler import ProfilerActivity, profile

    from minite.rollout import SamplingParams
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)
    for _ in range(3):  # compiles, then the graphs' captures (a shape's first decode step runs eagerly)
        engine.generate(prompts, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    found = steps(events)
    return summarise(found[len(found) // 2]) if found else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--top", type=int, default=30, help="kernel names printed per engine")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("a GPU tool: the profiler records no device events on the CPU")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rollout as br
    from provenance import stamp
    from shapes import FULL

    from minite.rollout.embedded import EmbeddedEngine, build_embedded
    ra = br.parse(["--layers", str(a.layers), "--prompt-len", str(a.prompt_len), "--new-tokens", "40"])
    shape = dict(FULL)
    doc = {"device": br.device_name(), **stamp(), "batch": a.batch, "layers": a.layers, "engines": {}}
    prompts = torch.randint(1, shape["vocab_size"], (a.batch, a.prompt_len),
                            generator=torch.Generator().manual_seed(a.batch)).tolist()
    for precision in ("nvfp4", "bf16"):
        model = build_embedded(br.engine_config(ra, shape, precision)).model
        for graphs in (False, True):
            kw = dict(br.VARIANTS[br.SHIPS[precision]], cuda_graphs=graphs)
            engine = EmbeddedEngine(model, strict=False, sampler="gumbel", **kw)
            key = f"{precision}-{'graphs' if graphs else 'eager'}-b{a.batch}"
            row = profile_engine(engine, prompts, a.new_tokens)
            doc["engines"][key] = row
            if row:
                print(f"{key}: {row['kernels']} kernels, span {row['span_us']:.1f} us, busy {row['busy_us']:.1f} us",
                      flush=True)
                for name, count, total in row["by_name"][: a.top]:
                    print(f"   {count:4d} x {total / count:7.2f} us = {total:8.1f}  {name[:100]}")
            else:
                print(f"{key}: no decode step found (no {STEP_END} kernel)", flush=True)
            del engine
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
