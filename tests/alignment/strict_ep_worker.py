"""Worker for test_strict_ep.py: one strict-mode RL step of the real loop (learner + embedded engine), EP from argv.

    python strict_ep_worker.py OUT.json 1                          EP=1, one process
    torchrun --nproc_per_node 2 strict_ep_worker.py OUT.json 2     EP=2 (DP=2 for the dense part)
Rank 0 writes the step's metrics (or the traceback) to OUT.json.
"""
import json
import sys
import traceback

import torch.distributed as dist

from minite.config import load_config
from minite.rl.loop import train
from tests import distributed_backend as backend


def main():
    out, ep = sys.argv[1], int(sys.argv[2])
    if ep > 1:
        backend.init()
    sets = {"precision.mode": "nvfp4", "alignment.strict": True, "parallel.ep": ep, "rl.steps": 1,
            "rl.warmup_steps": 0, "rl.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 4,
            "rl.minibatches": 1, "logging.dir": "''", "logging.tensorboard": False, "logging.progress_bar": False}
    try:
        report = {"history": train(load_config(None, [f"{k}={v}" for k, v in sets.items()]))}
    except Exception:
        report = {"error": traceback.format_exc()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
