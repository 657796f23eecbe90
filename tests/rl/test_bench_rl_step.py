"""tools/bench/bench_rl_step.py on CPU with a tiny config: it runs the real loop, writes the documented JSON keys
(device, date, commit, command, rows with gpus/layout/precision/strict/rollout_s/train_s/sync_s/step_s/tokens_per_s)
into a temporary file, and a second invocation of the same row replaces it while another row is added."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "bench_rl_step.py"
TINY = ["--set", "rl.warmup_steps=0", "--set", "rl.prompts_per_step=2", "--set", "rollout.group_size=2",
        "--set", "rl.minibatches=1", "--steps", "1", "--skip", "0"]


def _bench(out, *extra):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "examples/tiny/nvfp4.yaml", *TINY, *extra, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bench_rl_step_writes_the_documented_rows(tmp_path):
    out = tmp_path / "rl-step.json"
    _bench(out)
    _bench(out)
    _bench(out, "--set", "precision.mode=bf16")
    _bench(out, "--set", "precision.mode=bf16", "--set", "rl.micro_batches=2")
    doc = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "rows"} <= set(doc)
    assert doc["device"].startswith("CPU") and "bench_rl_step.py" in doc["command"]
    assert [(r["precision"], r["layout"], r["gpus"], r["strict"], r["micro_batches"]) for r in doc["rows"]] == [
        ("nvfp4", "single", 0, False, 1), ("bf16", "single", 0, False, 1), ("bf16", "single", 0, False, 2)]
    assert all(r["peak_mem_gib"] is None for r in doc["rows"])  # no GPU here
    for r in doc["rows"]:
        parts = [r[k] for k in ("rollout_s", "train_s", "sync_s")]
        assert all(p >= 0 for p in parts) and sum(parts) <= r["step_s"], r
        assert r["tokens_per_s"] > 0
    table = subprocess.run([sys.executable, str(BENCH), "--render", str(out)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert table[2].startswith("| gpus | layout | precision | strict | micro-batches |") and len(table) == 4 + 3
    assert table[4].startswith("| 0 | single | bf16 | no | 1 | ")
    assert table[5].startswith("| 0 | single | bf16 | no | 2 | ")
    assert table[6].startswith("| 0 | single | nvfp4 | no | 1 | ") and "| - |" in table[6]
