"""The learner splits the batch's rows over data-parallel ranks and still takes the unsharded full-batch step.

Two processes' worth of runs of data_parallel_worker.py, started together: the single-process reference (plain
python, world size 1) and one torchrun launch on 2 ranks (gloo, CPU) with DP=2 (TP=EP=1) and EP=2 (DP=2 for the
dense parameters). Each does STEPS GRPO steps on one fixed batch whose rows have unequal response lengths. Checks:
- each rank's model forwards received only its block of rows (rank 0 rows 0-1, rank 1 rows 2-3), and a batch
  that does not split over the ranks is a ValueError;
- per step, the loss, the loss_fn's metrics and the grad norm equal the reference's: the loss is the token mean
  over the whole batch, not a mean of per-rank means (which the reference shows would differ by far more);
- log-probs before training and the weights after the last step equal the reference's (gathered to TP=EP=1);
- routing replay through the loop (loop._replay) gives each rank the routes of its own rows.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed_backend import torchrun, worker_env
from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("data_parallel_worker.py")
CONFIGS = ["bf16_dp2", "bf16_ep2_dp2"]
STEPS = 3
TIMEOUT_S = 240
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun launches



def _load(out: Path, name: str) -> dict:
    rep = json.loads((out / f"{name}.json").read_text())
    assert "error" not in rep, f"{name}:\n{rep['error']}"
    return {**rep, "weights": torch.load(out / f"{name}.pt")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun on PATH (torch's launcher)")
    out = tmp_path_factory.mktemp("data_parallel")
    env = worker_env(ROOT)
    single = subprocess.Popen([sys.executable, str(WORKER), str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    proc = torchrun(WORKER, out, cwd=ROOT, env=env, timeout=TIMEOUT_S)
    single_log = single.communicate(timeout=TIMEOUT_S)[0]
    if single.returncode != 0 or not (out / "single.json").exists():
        pytest.fail(f"single-process reference failed (rc={single.returncode}):\n{single_log[-6000:]}")
    if proc.returncode != 0 or not all((out / f"{c}.json").exists() for c in CONFIGS):
        pytest.fail(f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {name: _load(out, name) for name in ["single"] + CONFIGS}


@pytest.mark.parametrize("key", CONFIGS)
def test_each_rank_forwards_only_its_rows(runs, key):
    r = runs[key]
    assert r["dp"] == 2 and r["local_experts"] == (2 if "ep2" in key else 4), r
    assert [p["rows"] for p in r["per_rank"]] == [[0, 2], [2, 4]]
    # one logprobs pass + STEPS train steps, each forwarding exactly tokens[rows] on its rank
    assert all(p["saw_only_its_rows"] and p["forwards"] == 1 + STEPS for p in r["per_rank"]), r["per_rank"]
    assert "does not split over 2 data-parallel ranks" in r["odd_rows_error"]


@pytest.mark.parametrize("key", CONFIGS)
def test_sharded_steps_equal_the_single_process_run(runs, key):
    ref, r = runs["single"], runs[key]
    atol, rtol = TOLERANCES["learner_parallel_fp32"]
    lp_gap = max(abs(a - b) for ra, rb in zip(r["logp0"], ref["logp0"]) for a, b in zip(ra, rb))
    assert lp_gap <= atol, lp_gap
    assert len(r["steps"]) == len(ref["steps"]) == STEPS
    for i, (got, want) in enumerate(zip(r["steps"], ref["steps"])):
        assert set(got) == set(want), (got, want)
        for k in set(want) - {"grad_norm"}:
            assert abs(got[k] - want[k]) <= atol, (i, k, got[k], want[k])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= rtol * want["grad_norm"], (i, got, want)
    w_atol, _ = TOLERANCES["learner_data_parallel_weights"]
    assert set(r["weights"]) == set(ref["weights"])
    gaps = {n: float((r["weights"][n] - w).abs().max()) for n, w in ref["weights"].items()}
    worst = max(gaps, key=gaps.get)
    print(f"{key}: max |dlogp0| {lp_gap:.3g}, max |dweight| {gaps[worst]:.3g} ({worst})")
    assert gaps[worst] <= w_atol, (worst, gaps[worst])


def test_routing_replay_replays_each_ranks_own_rows(runs):
    """loop._replay hands each rank the routes of its share of the rows (whole batch and a minibatch): replaying
    the routes the router picks anyway changes nothing, while another row's routes do change the log-probs."""
    for gaps in (p["replay_gaps"] for p in runs["bf16_dp2"]["per_rank"]):
        assert gaps["full"] == 0 and gaps["minibatch"] == 0, gaps  # same routes, same ops: bitwise
        assert gaps["wrong_rows"] > 1e-3, gaps


def test_loss_is_the_global_token_mean(runs):
    """The batch is built so that a per-rank token mean averaged over ranks is far from the global token mean:
    the equalities above would fail for that normalisation."""
    atol, _ = TOLERANCES["learner_parallel_fp32"]
    ref = runs["single"]
    assert abs(ref["steps"][0]["loss"] - ref["loss0_mean_of_rank_means"]) > 1000 * atol, ref["steps"][0]
    assert ref["steps"][-1]["train/clip_frac"] > 0  # the later steps exercise the clipped branch
