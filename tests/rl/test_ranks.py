"""minite/rl/ranks.py over two ranks (gloo on CPU, NCCL with two GPUs): every rank trains on rank 0's rollouts and
routes, and a row whose copy differed on some rank is counted on every rank."""
import json
from pathlib import Path

import pytest

from tests.distributed_backend import torchrun, worker_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def test_every_rank_gets_rank0s_rollouts_and_routes(tmp_path):
    proc = torchrun(Path(__file__).with_name("ranks_worker.py"), tmp_path, cwd=ROOT, env=worker_env(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reps:
        assert rep["tokens"] == [[3, 4, 5]] * 4 and rep["logprobs"] == [[-0.5, -0.25, -0.125]] * 4
        assert rep["routes"] == [0, 0]  # rank 0's routes (all zeros), broadcast in place
        assert rep["same_route_objects"] and rep["differ"] == 1


def test_a_single_rank_gets_its_own_back():
    from minite.rl.ranks import rank0_rollouts
    from minite.rollout.base import RolloutResult

    rollouts = [RolloutResult(0, [1], [2], [-1.0], True)]
    assert rank0_rollouts(rollouts, None) == (rollouts, None, None)
