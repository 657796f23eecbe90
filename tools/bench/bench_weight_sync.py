"""Weight sync learner -> embedded rollout engine against a device-to-device copy of the same bytes.

    python tools/bench/bench_weight_sync.py --layers 4 --out sync.json          (one H200: the full-width slice)
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench/bench_weight_sync.py --ep 2 ...
    python tools/bench/bench_weight_sync.py --tiny                              (CPU smoke run)

What the RL loop does each step (`minite.rl.loop.sync_weights`): `engine.update_weights(learner.named_weights())`,
i.e. the checked copy (names, shapes, finiteness) of every parameter and, for NVFP4, the re-quantisation of every
weight into the engine's cache. The learner is built frozen (no optimizer: the source tensors are the same, the
fp32 master weights and Adam moments would only take memory). The reference is one `copy_` of a flat buffer of
the engine's parameter bytes (same dtype, same device): the floor of any sync that moves those bytes once.
Medians over --steps after --warmup, synchronised; rank 0 prints and writes (under EP each rank syncs its shard).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from profiling import print_top  # tools/bench/, beside this script
from shapes import FULL, TINY


def _timed(fn, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(precision: str, shape: dict, layers: int, steps: int, warmup: int, ep: int, profile: int = 0) -> dict:
    from minite.config import load_config
    from minite.learner.learner import Learner
    from minite.rollout.embedded import build_embedded

    sets = [f"model.{k}={v}" for k, v in shape.items()]
    sets += [f"model.num_layers={layers}", f"precision.mode={precision}", f"parallel.ep={ep}"]
    cfg = load_config(None, sets)
    learner = Learner(cfg, frozen=True)
    engine = build_embedded(cfg)
    params = [p for _, p in engine.named_weights()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    src = torch.empty(nbytes, dtype=torch.uint8, device=params[0].device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), steps, warmup)
    sync_s = _timed(lambda: engine.update_weights(learner.named_weights()), steps, warmup)
    if profile:
        print_top(lambda: engine.update_weights(learner.named_weights()), profile, f"{precision} weight sync",
                  show=int(os.environ.get("RANK", "0")) == 0)
    out = {"precision": precision, "layout": f"ep{ep}" if ep > 1 else "single", "bytes_per_rank": nbytes,
           "tensors": len(params), "sync_s": sync_s, "copy_s": copy_s, "sync_over_copy": sync_s / copy_s,
           "copy_gb_per_s": 2 * nbytes / copy_s / 1e9}  # a copy reads and writes every byte
    del learner, engine, src, dst
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (run under torchrun with that many ranks)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="after timing, profile one more sync and print the TOP ops by device and host time")
    a = p.parse_args()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    rows = [run(prec, TINY if a.tiny else FULL, a.layers, a.steps, a.warmup, a.ep, a.profile) for prec in a.precisions.split(",")]
    if not rank0:
        return
    result = {"layers": a.layers, "rows": rows,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "commit": os.environ.get("MINITE_COMMIT", "unknown")}
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
