"""tools/launch/torchrun.sh as a user calls it from their own directory: the config path and relative paths resolve
from that directory, OMP_NUM_THREADS is the cores available divided by the ranks, and the per-rank logs land in
LOG_DIR (default logs/<date-time> under the caller's directory). The entry point is a tiny script
(MINITE_LAUNCH_ENTRY) that reports what each rank sees, so the launcher is tested without a training run."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tools" / "launch" / "torchrun.sh"
TIMEOUT_S = 120
pytestmark = pytest.mark.distributed

ENTRY = """import json, os, sys
from pathlib import Path
cfg = Path(sys.argv[1])
Path(f"seen.rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"cwd": os.getcwd(), "config_exists": cfg.is_file(), "args": sys.argv[1:],
     "omp": os.environ.get("OMP_NUM_THREADS")}))
print("entry ran on rank", os.environ["RANK"])
"""


def _env(**extra):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "LOG_DIR"):
        env.pop(k, None)
    env.update(extra)
    return env


@pytest.fixture
def caller_dir(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun on PATH (torch's launcher)")
    (tmp_path / "my.yaml").write_text("rl:\n  steps: 1\n")
    (tmp_path / "entry.py").write_text(ENTRY)
    return tmp_path


def test_torchrun_sh_resolves_paths_from_the_caller_and_sizes_threads(caller_dir):
    proc = subprocess.run(["bash", str(LAUNCHER), "my.yaml", "--set", "rl.steps=2"], cwd=caller_dir, text=True,
                          capture_output=True, timeout=TIMEOUT_S,
                          env=_env(NPROC_PER_NODE="2", MINITE_LAUNCH_ENTRY="entry.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))  # what nproc reports
    for rank in (0, 1):
        seen = json.loads((caller_dir / f"seen.rank{rank}.json").read_text())
        assert seen["cwd"] == str(caller_dir) and seen["config_exists"], seen
        assert seen["args"] == ["my.yaml", "--set", "rl.steps=2"]
        assert seen["omp"] == str(max(1, cores // 2)), seen
    logs = list((caller_dir / "logs").glob("*/*/attempt_0/[01]/stdout.log"))
    assert len(logs) == 2, sorted(str(p) for p in (caller_dir / "logs").rglob("*"))
    assert any("entry ran on rank 1" in p.read_text() for p in logs)


def test_torchrun_sh_names_a_missing_config(caller_dir):
    proc = subprocess.run(["bash", str(LAUNCHER), "nope.yaml"], cwd=caller_dir, text=True, capture_output=True,
                          timeout=TIMEOUT_S, env=_env(NPROC_PER_NODE="1", MINITE_LAUNCH_ENTRY="entry.py"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"config nope.yaml not found (relative paths resolve from {caller_dir}): pass the path of a YAML config")
