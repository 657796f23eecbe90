"""tools/compare_runs.py, the kill-and-resume check of the GPU acceptance: same runs pass, a one-bit difference in a
checkpoint tensor or a metric fails, wall-clock metrics and the saved config are ignored."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(d: Path, *, weight: torch.Tensor, reward: float, seconds: float, config: str) -> Path:
    (d / "ck" / "step_000002").mkdir(parents=True)
    rows = [{"step": s, "reward/mean": reward, "time/step_s": seconds * s} for s in (1, 2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.save({"learner": {"w": weight, "step": 2}, "config": config}, d / "ck" / "step_000002" / "state.pt")
    return d


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(a), str(b)],
                          capture_output=True, text=True, timeout=120)


def test_same_runs_pass_and_one_bit_fails(tmp_path):
    w = torch.randn(4, 4)
    a = _run(tmp_path / "a", weight=w, reward=0.5, seconds=1.0, config="dir: a")
    b = _run(tmp_path / "b", weight=w.clone(), reward=0.5, seconds=2.0, config="dir: b")
    same = _compare(a, b)
    assert same.returncode == 0 and same.stdout.strip().endswith("same"), same.stdout + same.stderr
    flipped = w.clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # the last mantissa bit of one element
    c = _run(tmp_path / "c", weight=flipped, reward=0.5, seconds=1.0, config="dir: a")
    diff = _compare(a, c)
    assert diff.returncode == 1 and "state.pt/learner/w: tensor bits differ" in diff.stdout, diff.stdout
    d = _run(tmp_path / "d", weight=w.clone(), reward=0.25, seconds=1.0, config="dir: a")
    diff = _compare(a, d)
    assert diff.returncode == 1 and "step 1: metrics differ" in diff.stdout, diff.stdout
