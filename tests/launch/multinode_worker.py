"""Worker for tests/launch/test_multinode.py: takes `minite train`'s arguments, runs fixed-batch learner steps.

The launchers (tools/launch/torchrun.sh, tools/launch/slurm.sbatch) start it in place of `minite train` through
MINITE_LAUNCH_ENTRY, with the same command line (CONFIG [--set key=value ...]). For each case in CASES (overrides on
top of that config) it builds the Learner, runs STEPS train steps on one fixed batch with loss -mean(logp), and
records the losses and grad norms. With $MINITE_TEST_CKPT (checkpoints from `minite convert hf-to-megatron` for
ep1/ep2/tp2), LOAD_CASES load them into learners of those layouts and record the batch's log-probs. Rank 0 writes {case: {...}, "world": ..., "node_ranks": ...} to
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
LOAD_CASES = {  # name: (converted checkpoint subdirectory, overrides): log-probs of converted weights per layout
    "load_ep1": ("ep1", ["parallel.ep=1"]),
    "load_ep2": ("ep2", ["parallel.ep=2"]),
    "load_tp2": ("tp2", ["parallel.tp=2"]),
}
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


def run_load_case(config, overrides, ckpt_root, sub, tokens):
    """Build the learner for the layout, load `minite convert`'s per-rank files into it, score the batch."""
    from megatron.core import parallel_state as ps
    from minite.convert.hf_megatron import load_into_model

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    hf_config = os.path.join(ckpt_root, "hf", "config.json")
    learner = Learner(load_config(config, overrides + [f"model.hf_config={hf_config}", "precision.mode=bf16",
                                                       "precision.compute_dtype=float32"]))
    loaded = load_into_model(learner.model, os.path.join(ckpt_root, sub))
    return {"logp": learner.logprobs(tokens).tolist(), "tensors_loaded": len(loaded)}


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
    ckpt_root = os.environ.get("MINITE_TEST_CKPT")
    for name, (sub, extra) in LOAD_CASES.items() if ckpt_root and "error" not in str(report) else ():
        try:
            report[name] = run_load_case(config, overrides + extra, ckpt_root, sub, tokens)
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
