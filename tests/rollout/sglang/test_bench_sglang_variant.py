"""tools/bench/bench_rollout.py --variants sglang: SGLang's engine with the plugin measured like the embedded engine
(CPU smoke run in a subprocess, the tiny shapes): a row with the fixed keys, the engine's arguments, its start-up and
one weight update's seconds, and the engine shut down after (no /tmp/minite-sglang-* checkpoint left)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.sglang.conftest import STUBS, sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

ROOT = Path(__file__).resolve().parents[3]


def test_sglang_rows(tmp_path):
    out = tmp_path / "rollout.json"
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (STUBS, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "tools/bench/bench_rollout.py", "--tiny", "--batches", "2", "--prompt-len", "4",
           "--new-tokens", "10", "--short-tokens", "2", "--precisions", "nvfp4", "--variants", "sglang",
           "--modes", "default", "--no-reference", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [], doc["errors"]
    (row,) = doc["rows"]
    assert row["variant"] == "sglang" and row["step_method"] == "difference" and row["batch"] == 2
    assert row["engine_args"]["quantization"] == "minite_nvfp4"
    # step_ms is one long-minus-short difference on a busy CPU: present, not necessarily positive
    assert isinstance(row["step_ms"], float) and row["t_long_s"] > 0 and row["t_short_s"] > 0
    assert row["weight_update_s"] > 0 and row["startup_s"] > 0 and "weight_update_error" not in row
    assert set(row["weight_update_phases_s"]) == {"validate", "pack", "load"}
    assert not list(tmp_path.glob("minite-sglang-*"))
