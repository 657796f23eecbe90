"""Strict mode under expert parallelism: one RL step of the real loop with EP=2 on 2 ranks (torchrun; gloo on CPU,
NCCL with two GPUs) has a learner/rollout log-prob gap of exactly 0, and its rollout and loss equal the EP=1 strict
run's bit for bit (the initial model is layout-invariant, every strict op is row-local, and the combine sums each
token's experts in ascending global expert order on either layout; see minite/alignment/strict.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_backend import torchrun, worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("strict_ep_worker.py")
TIMEOUT_S = 900
pytestmark = pytest.mark.distributed



def _read(path: Path, log: str) -> list:
    if not path.exists():
        pytest.fail(f"no report from the worker:\n{log[-6000:]}")
    rep = json.loads(path.read_text())
    assert "error" not in rep, rep["error"]
    return rep["history"]


def test_strict_ep2_gap_is_zero_and_equals_ep1(tmp_path):
    env = worker_env(ROOT)
    one = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "ep1.json"), "1"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    two = torchrun(WORKER, tmp_path / "ep2.json", 2, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    ep1 = _read(tmp_path / "ep1.json", one.stdout + one.stderr)
    ep2 = _read(tmp_path / "ep2.json", two.stdout + two.stderr)
    assert ep2[0]["mismatch/logp_abs_max"] == 0.0 and ep1[0]["mismatch/logp_abs_max"] == 0.0
    for key in ("reward/mean", "rollout/response_len", "train/entropy", "loss/policy"):
        assert ep2[0][key] == ep1[0][key], key
