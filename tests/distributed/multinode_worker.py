"""Worker for tests/distributed/test_multinode.py: takes `minite train`'s arguments, runs fixed-batch learner steps.

The launchers (tools/launch/torchrun.sh, tools/launch/slurm.sbatch) start it in place of `minite train` through
MINITE_LAUNCH_ENTRY, with the same command line (CONFIG [--set key=value ...]). For each case in CASES (overrides on
top of that config) it builds the Learner, runs STEPS train steps on one fixed batch with loss -mean(logp), and
records the losses and grad norms. Rank 0 writes {case: {...}, "world": ..., "node_ranks": ...} to
$MINITE_TEST_OUT. Exceptions are reported in the JSON rather than left to hang the other ranks.
"""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from minite.config import load_config
from minite.learner.learner import Learner

STEPS = 3
CASES = {  # name: overrides; EP=2 spans both "nodes" when each node runs one process
    "bf16_ep2": ["precision.mode=bf16", "precision.compute_dtype=float32", "parallel.ep=2"],
    "bf16_ep1": ["precision.mode=bf16", "precision.compute_dtype=float32", "parallel.ep=1"],
    "nvfp4_ep2": ["precision.mode=nvfp4", "precision.compute_dtype=float32", "parallel.ep=2"],
}


def loss_fn(logp):
    return -logp.mean(), {}


def run_case(config, overrides, tokens):
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    learner = Learner(load_config(config, overrides))
    steps = [learner.train_step(tokens, loss_fn) for _ in range(STEPS)]
    return {"loss": [m["loss"] for m in steps], "grad_norm": [m["grad_norm"] for m in steps],
            "local_experts": learner.model.decoder.layers[0].mlp.experts.num_local_experts}


def main():
    config, overrides = sys.argv[1], [a for a in sys.argv[2:] if a != "--set"]
    tokens = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    report = {}
    for name, extra in CASES.items():
        try:
            report[name] = run_case(config, overrides + extra, tokens)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
            break
    node_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(node_ranks, int(os.environ.get("GROUP_RANK", -1)))  # torchrun's node rank
    report.update(world=dist.get_world_size(), node_ranks=node_ranks)
    if dist.get_rank() == 0:
        with open(os.environ["MINITE_TEST_OUT"], "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
