"""The RL job under tensor parallelism: `tools/launch/torchrun.sh` runs the real `minite train` on two gloo ranks with
parallel.tp=2 (the embedded engine and the learner both TP=2, EP=1). Before 2026-12-05 the engine refused TP > 1 at
EP = 1 at its first rollout (Megatron's static-inference guard) and, past that, the learner's TP ranks clipped by
different gradient norms, so the rollout's policy drifted from the learner's (docs/upstream.md). Checks: the job
finishes, and the learner/rollout log-prob gap stays within tolerances.py's tp2_rl_logp_gap at every step."""
import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed_backend import run_ranks
from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) only: the bound and the bitwise ops are this CPU's (default mode "
                                      "promises no bitwise agreement on GPUs), and `minite` takes a GPU a rank")]


@pytest.mark.parametrize("precision,extra", [("bf16", []), ("nvfp4", []),
                                             ("nvfp4", ["--set", "alignment.routing_replay=true"])])
def test_rl_job_with_tp2_keeps_learner_and_rollout_together(tmp_path, precision, extra):
    """extra: routing replay, whose routes each TP rank's learner slices to its share of the sequence."""
    env = dict(os.environ, NPROC_PER_NODE="2", LOG_DIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1")
    proc = run_ranks(["bash", "tools/launch/torchrun.sh", f"examples/tiny/{precision}.yaml", "--fresh",
                      "--set", "parallel.tp=2", "--set", "rl.steps=5", "--set", "checkpoint.dir=null",
                      "--set", f"logging.dir={tmp_path / 'run'}", "--set", "logging.progress_bar=false", *extra],
                     cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    gaps = [r["mismatch/logp_abs_max"] for r in rows]
    assert max(gaps) <= TOLERANCES["tp2_rl_logp_gap"][0], gaps
    assert all(r["rollout/rows_differ"] == 0 for r in rows)  # the TP ranks sampled the same batch
