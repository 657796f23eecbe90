"""Two ranks (torchrun; gloo on CPU, NCCL with two GPUs) run the real RL loop with DP=2, EP=2 and TP=2: a run
interrupted after its checkpoint and resumed equals the uninterrupted run bit for bit (every step's metrics, and every
rank's shard of the final checkpoint), each rank writes its own shard (EP=2: its half of the experts) into one manifest,
and only rank 0 writes metrics.jsonl and TensorBoard files (checkpoint_worker.py says what runs)."""
import json
from pathlib import Path

import pytest

from tests.distributed_backend import torchrun, worker_env
from tests.rl.checkpoint_worker import LAYOUTS, STEPS

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_worker.py")
TIMEOUT_S = 900
pytestmark = pytest.mark.distributed



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint_resume")
    env = worker_env(ROOT)
    proc = torchrun(WORKER, out, cwd=ROOT, env=env, timeout=TIMEOUT_S)
    reports = {}
    for name in LAYOUTS:
        f = out / f"{name}.json"
        if not f.exists():
            pytest.fail(f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        rep = json.loads(f.read_text())
        for r in rep["ranks"]:
            assert "error" not in r, f"{name}:\n{r['error']}"
        reports[name] = rep
    return out, reports


def _untimed(metrics: dict) -> dict:
    """A step's metrics without the wall-clock ones (time/*, throughput/*), which no two runs share."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "throughput/"))}


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_equals_the_uninterrupted_run_bitwise(runs, name):
    _, reports = runs
    for rank, r in enumerate(reports[name]["ranks"]):
        straight, interrupted, resumed = ([_untimed(h) for h in r["history"][k]]
                                          for k in ("straight", "interrupted", "resumed"))
        assert [h["step"] for h in interrupted] == [1, 2] and [h["step"] for h in resumed] == [3, 4], rank
        assert straight[2:] == resumed, rank  # every metric of steps 3, 4, exactly
        assert straight[:2] == interrupted, rank
        assert r["final_state_equal"], rank  # model, optimizer, RNG states, prompt stream: every tensor bitwise


def test_each_rank_saves_its_own_shard_under_one_manifest(runs):
    _, reports = runs
    for name, rep in reports.items():
        shards = rep["ranks"][0]["manifest"]
        assert [s["file"] for s in shards] == ["state.pt", "state.rank00001.pt"], name
        assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in shards), name
    for rank in (0, 1):  # EP=2: each rank holds 2 of the 4 experts, so the two shards hold the whole model
        experts = reports["ep2"]["ranks"][rank]["experts"]
        assert experts and all(shape[0] == 2 for shape in experts.values()), experts
        assert all(shape[0] == 4 for shape in reports["dp2"]["ranks"][rank]["experts"].values())


@pytest.mark.parametrize("name", LAYOUTS)
def test_rank_zero_alone_writes_metrics_and_tensorboard(runs, name):
    out, _ = runs
    for logs, runs_logged in (("logs_straight", 1), ("logs_resume", 2)):
        d = out / name / logs
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), (logs, rows)
        assert len(list(d.glob("events.out.tfevents.*"))) == runs_logged, logs  # one per run that logged, rank 0
    assert not list((out / name / "ck_resume").glob(".tmp-*"))
