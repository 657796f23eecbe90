"""tools/bench/merge_runs.py, which tools/gpu_acceptance.sh's `ab` stage runs on the device: rows of several runs in
one file with their run names and commits; runs of another device refused."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_file(path, commit, step, device="1x NVIDIA H100 80GB HBM3"):
    path.write_text(json.dumps({"device": device, "torch": "2.11", "hbm_bytes_per_s": 3.35e12, "shape": {"layers": 4},
                                "date": "2026-12-08", "commit": commit, "command": "bench_rollout.py",
                                "rows": [{"precision": "nvfp4", "strict": False, "batch": 64, "step_ms": step}]}))
    return str(path)


def test_rows_keep_their_run_and_commit(tmp_path):
    files = [_run_file(tmp_path / "ab-off1.json", "abc", 1.32), _run_file(tmp_path / "ab-on1.json", "abc+T", 1.25)]
    out = subprocess.run([sys.executable, str(ROOT / "tools/bench/merge_runs.py"), str(tmp_path / "m.json"), *files],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [(r["run"], r["commit"], r["step_ms"]) for r in merged["rows"]] == [("off1", "abc", 1.32),
                                                                             ("on1", "abc+T", 1.25)]
    assert merged["device"] == "1x NVIDIA H100 80GB HBM3" and "on1    nvfp4" in out.stdout


def test_another_device_is_refused(tmp_path):
    files = [_run_file(tmp_path / "ab-off1.json", "abc", 1.3),
             _run_file(tmp_path / "ab-on1.json", "abc", 1.2, device="1x NVIDIA H200")]
    out = subprocess.run([sys.executable, str(ROOT / "tools/bench/merge_runs.py"), str(tmp_path / "m.json"), *files],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "merge_runs: " in out.stderr and "1x NVIDIA H200" in out.stderr
    assert not (tmp_path / "m.json").exists()
