"""tools/bench/bench_rollout_lengths.py on the CPU (a tiny model): the responses end where the tool sets them (it
checks every generate), the stop and compaction rows run fewer rows than the whole batch in their late steps, and the
rows carry the keys docs/benchmarks.md reads."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "bench_rollout_lengths.py"
sys.path.insert(0, str(BENCH.parent))

import bench_rollout_lengths  # noqa: E402  (a script's module, found through its folder)


def test_lengths_are_drawn_within_the_limit():
    for kind in ("uniform", "geometric"):
        lengths = bench_rollout_lengths.draw_lengths(kind, 256, 40)
        assert len(lengths) == 256 and min(lengths) >= 1 and max(lengths) <= 40
        assert lengths == bench_rollout_lengths.draw_lengths(kind, 256, 40)  # seeded
    assert sum(bench_rollout_lengths.draw_lengths("geometric", 256, 40)) < sum(
        bench_rollout_lengths.draw_lengths("uniform", 256, 40))  # mean 10 against 20.5


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "lengths.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--batch", "8", "--new-tokens", "12", "--repeats",
                           "1", "--precisions", "bf16", "--check-every", "2", "--lengths", "geometric", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "lengths", "rows"} <= set(doc)
    rows = {(r["strict"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(s, v) for s in (False, True) for v in ("never", "stop", "compact")}
    total = sum(min(n, 12) for n in doc["lengths"])
    for r in rows.values():
        assert r["tokens"] == total and r["generate_s"] > 0 and r["stop_check_every"] == (0 if r["variant"] == "never"
                                                                                           else 2)
    never, stop = rows[(True, "never")], rows[(True, "stop")]
    assert never["steps"] == 11 and stop["steps"] <= never["steps"]
    assert never["min_step_rows"] == 8 > stop["min_step_rows"]  # eager on the CPU: compacted
