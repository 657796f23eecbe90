"""`minite diagnose` under tensor parallelism: the real `minite` command on two gloo ranks (torchrun) with
parallel.tp=2. The learner trains with sequence parallelism (each TP rank holds a slice of the sequence) while the
engine decodes whole sequences; diagnose scores without it, so every rank's captured ops line up with the engine's
position by position. Before 2026-12-05 the op table compared a rank's slice with the engine's first positions and
named a divergent op (and route flips) where there was none."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_backend import torchrun, worker_env
from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) only: the bound and the bitwise ops are this CPU's (default mode "
                                      "promises no bitwise agreement on GPUs), and `minite` takes a GPU a rank")]


def test_diagnose_at_tp2_finds_every_op_equal(tmp_path):
    minite = shutil.which("minite")
    if minite is None:
        pytest.skip("needs the minite command (pip install -e .)")
    out = tmp_path / "report.json"
    proc = torchrun(Path(minite), "diagnose", ROOT / "examples/tiny/bf16.yaml", "--b", "embedded", "--set",
                    "parallel.tp=2", "--json", out, cwd=tmp_path, env=worker_env(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ops_compared"] > 0 and r["first_divergent_op"] is None, r["ops"][:5]
    assert r["route_flips"] == 0
    assert r["tokens_compared"] > 0 and r["max_abs_logp_gap"] <= TOLERANCES["tp2_diagnose_logp_gap"][0], r
