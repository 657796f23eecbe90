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


def _env(tmp_path, **extra):
    """(environment, its TMPDIR): SGLang's stand-ins first on PYTHONPATH, temporary files in a folder of the test."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (STUBS, os.environ.get("PYTHONPATH", "")) if p), **extra}, tmp


def _run(tmp_path, *args):
    env, tmp = _env(tmp_path)
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


@pytest.mark.distributed
def test_train_with_sglang_on_two_ranks(tmp_path):
    """tools/launch/torchrun.sh with two data-parallel ranks, each with its own SGLang engine. Both engines hung at
    their start before 2026-12-05: torchrun's TORCHELASTIC_USE_AGENT_STORE made each scheduler's one-process group a
    client of a store nobody served, and with it unset, both ranks drew the same port from the alike-seeded `random`
    (EADDRINUSE). The job runs its two steps, every step's gap is finite, and both engines are shut down."""
    import json
    import math

    from tests.distributed_backend import run_ranks

    env, tmp = _env(tmp_path, NPROC_PER_NODE="2", LOG_DIR=str(tmp_path / "logs"))
    sets = [a for s in TINY + ["rl.steps=2", f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=null"]
            for a in ("--set", s)]
    out = run_ranks(["bash", str(REPO / "tools/launch/torchrun.sh"), str(REPO / "examples/tiny/nvfp4.yaml"), *sets],
                    cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| rollout sglang | CPU, 2 processes |" in out.stdout and "done, 2 RL steps" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["mismatch/logp_abs_max"]) for r in rows)
    assert sorted(p.name for p in tmp.glob("minite-sglang-*")) == []
