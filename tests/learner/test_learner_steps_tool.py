"""tools/bench/learner_steps.py runs through its command line: a strict NVFP4 learner of one small layer takes its
steps and prints their times, the loss and the peak memory; a bad argument is one usage error."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench" / "learner_steps.py"


def _run(*args):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_learner_steps_prints_its_line():
    proc = _run("--strict", "--tokens", "8", "--steps", "2", "--set", "model.num_layers=1",
                "--set", "model.num_experts=4", "--set", "model.moe_router_topk=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"nvfp4 strict 8 tokens: steps [\d.]+ / [\d.]+ s \| loss [\d.]+ grad_norm [\d.]+ \| peak RSS "
                        r"[\d.]+ GiB", line), line
    bad = _run("--tokens", "1")
    assert bad.returncode == 2 and "--tokens must be >= 2" in bad.stderr
