"""Worker for test_checkpoint_resume.py: the real RL loop (`minite.rl.loop.train`, real Learner and embedded engine)
on 2 ranks, for each layout in LAYOUTS (DP=2; EP=2 with DP=2 for the dense parameters; TP=2 with sequence
parallelism, each rank its half of every partitioned weight):

    straight     STEPS RL steps, a checkpoint after every step
    interrupted  STEPS // 2 steps into another checkpoint dir (the run "dies" after its checkpoint)
    resumed      the same config with rl.steps=STEPS: resumes from the interrupted run's newest checkpoint

Between runs every rank scrambles its global RNGs (torch, NumPy, Python), as a new process would start. Each rank
reports its history and, for its own shard of the final checkpoint, whether the straight and resumed runs saved
equal states (every tensor bitwise); rank 0 writes OUT_DIR/<layout>.json with both ranks' reports.
"""
import json
import random
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl.loop import train
from tests import distributed_backend as backend

LAYOUTS = {"dp2": (1, 1), "ep2": (1, 2), "tp2": (2, 1)}  # name: (parallel.tp, parallel.ep)
STEPS = 4


def make_cfg(out: Path, tp: int, ep: int, run: str, steps: int, ck: str):
    sets = {"precision.mode": "nvfp4", "parallel.tp": tp, "parallel.ep": ep, "rl.steps": steps, "rl.warmup_steps": 1,
            "rl.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.minibatches": 2,
            "rl.task_length": 3, "model.vocab_size": 16, "model.max_position_embeddings": 32,
            "checkpoint.dir": str(out / ck), "checkpoint.every": 1, "checkpoint.keep": 0,
            "logging.dir": str(out / run), "logging.progress_bar": False}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def scramble(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def run_layout(out: Path, name: str, tp: int, ep: int) -> dict:
    from megatron.core import parallel_state as ps
    rank = dist.get_rank()
    hist = {}
    for i, (run, steps, ck) in enumerate([("straight", STEPS, "ck_straight"), ("interrupted", STEPS // 2, "ck_resume"),
                                          ("resumed", STEPS, "ck_resume")]):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        scramble(100 * i + rank)
        logs = "logs_straight" if run == "straight" else "logs_resume"
        hist[run] = train(make_cfg(out / name, tp, ep, logs, steps, ck))
    final = ckpt.step_dir(out / name / "ck_resume", STEPS)
    a = ckpt.load_checkpoint(ckpt.step_dir(out / name / "ck_straight", STEPS), rank=rank)
    b = ckpt.load_checkpoint(final, rank=rank)
    experts = {k: list(v.shape) for k, v in b["learner"]["model"].items() if "experts" in k and "fc1" in k}
    return {"history": hist, "final_state_equal": same(a, b), "experts": experts,
            "manifest": ckpt.read_manifest(final)["shards"] if rank == 0 else None}


def main():
    out = Path(sys.argv[1])
    used = backend.init()
    for name, (tp, ep) in LAYOUTS.items():
        try:
            report = run_layout(out, name, tp, ep)
        except Exception:  # report, do not leave the other rank waiting in a collective forever
            report = {"error": traceback.format_exc()}
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if dist.get_rank() == 0:
            (out / f"{name}.json").write_text(json.dumps({"backend": used, "ranks": reports}, indent=1))
        if any("error" in r for r in reports):
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
