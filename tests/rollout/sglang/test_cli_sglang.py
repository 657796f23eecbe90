"""`minite train` and `minite diagnose` with the SGLang backend, as real subprocesses on CPU: the engine is shut down
after success (its scheduler process and the temporary /tmp/minite-sglang-* checkpoint gone, no resource_tracker
traceback at exit) and SGLang's start-up chatter ("Ignore import error ...") stays off the terminal."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.sglang.conftest import STUBS, sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

MINITE = str(Path(sys.executable).parent / "minite")
REPO = Path(__file__).resolve().parents[3]
TINY = ["rollout.backend=sglang", "rl.steps=1", "rl.warmup_steps=0", "rl.prompts_per_step=2", "rollout.group_size=2",
        "rl.minibatches=1", "model.max_position_embeddings=16", "logging.progress_bar=false"]


def _run(tmp_path, *args):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (STUBS, os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([MINITE, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return out, tmp


def _assert_clean(out, tmp):
    assert out.returncode == 0, out.stderr[-3000:]
    for noise in ("Traceback", "resource_tracker", "Ignore import error"):
        assert noise not in out.stderr + out.stdout, out.stderr[-3000:]
    assert sorted(p.name for p in tmp.glob("minite-sglang-*")) == []


def test_train_with_sglang_shuts_the_engine_down(tmp_path):
    sets = [a for s in TINY + [f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'run' / 'ck'}"]
            for a in ("--set", s)]
    out, tmp = _run(tmp_path, "train", str(REPO / "examples/tiny/nvfp4.yaml"), *sets)
    _assert_clean(out, tmp)
    assert "| rollout sglang |" in out.stdout and "done, 1 RL steps" in out.stdout


def test_diagnose_with_sglang_shuts_the_engine_down(tmp_path):
    out, tmp = _run(tmp_path, "diagnose", "--config", str(REPO / "examples/tiny/nvfp4.yaml"), "--b", "sglang",
                    "--prompts", "2", "--max-new-tokens", "2", "--set", f"logging.dir={tmp_path / 'run'}")
    _assert_clean(out, tmp)
    assert out.stdout.startswith("learner vs sglang")
