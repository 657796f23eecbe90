"""Several bench_rollout.py JSON files of one device call in one file, each row stamped with its run's commit, date
and command and with `run`, the file's name after its first three characters and before .json (tools/
gpu_acceptance.sh's `ab` stage names them ab-off1.json, ab-on1.json, ...: runs off1, on1, ...), then a line per row.

    python tools/bench/merge_runs.py OUT.json RUN.json [RUN.json ...]

The header (device, torch, HBM bandwidth, shape) is the first file's; a file of another device or shape is refused
with a one-line error, so an A/B never mixes machines.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SAME = ("device", "torch", "hbm_bytes_per_s", "shape")


def merge(paths: list[str]) -> dict:
    rows, head = [], None
    for path in paths:
        d = json.loads(Path(path).read_text())
        here = {k: d.get(k) for k in SAME}
        if head is not None and here != head:
            raise SystemExit(f"merge_runs: {path} was measured on {here['device']} ({here['shape']}), not "
                             f"{head['device']} ({head['shape']}) as {paths[0]}")
        head = head or here
        run = Path(path).name[3:-len(".json")]
        rows += [dict(r, commit=d["commit"], date=d["date"], command=d["command"], run=run) for r in d["rows"]]
    return dict(head or {}, rows=rows)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit("usage: merge_runs.py OUT.json RUN.json [RUN.json ...]")
    out = merge(argv[1:])
    Path(argv[0]).write_text(json.dumps(out, indent=1))
    for r in out["rows"]:
        print(f"{r['run']:6} {r['precision']:6} {'strict' if r['strict'] else 'default':8} batch {r['batch']:4} "
              f"{r['step_ms']:.3f} ms  {r['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
