"""Are two `minite train` runs the same run? Compares, bit for bit, every RL step's metrics (wall-clock ones aside:
time/*, throughput/*) and every tensor of the newest checkpoint's shards (model, optimizer, RNG states, prompt
stream; the saved config aside, since the two runs' paths differ). For a killed-and-resumed run against an
uninterrupted one (tools/gpu_acceptance.sh's killresume stage).

    python tools/compare_runs.py RUN_DIR_A RUN_DIR_B      (each holding metrics.jsonl and checkpoints/ or ck/)

Prints one line per finding and `same` or `DIFFERENT`; exits 0 only when the runs are the same.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def metrics_by_step(run: Path) -> dict[int, dict]:
    """The last row logged for each step (a resumed run re-logs the steps after its checkpoint)."""
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[int(row["step"])] = {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
    return rows


def newest_checkpoint(run: Path) -> Path:
    steps = sorted(run.glob("*/step_*"))
    if not steps:
        raise SystemExit(f"no checkpoint under {run}")
    return max(steps, key=lambda p: int(p.name.split("_")[1]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads and signed zeros compared too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def diff(a, b, path: str = "") -> list[str]:
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: tensor type/shape differ"]
        same = torch.equal(_bits(a), _bits(b))
        return [] if same else [f"{path}: tensor bits differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ {sorted(set(a) ^ set(b), key=str)[:4]}"]
        return [d for k in a if not (path == "" and k == "config") for d in diff(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main(argv: list[str]) -> int:
    a, b = (Path(p) for p in argv[1:3])
    findings = []
    ma, mb = metrics_by_step(a), metrics_by_step(b)
    if sorted(ma) != sorted(mb):
        findings.append(f"steps differ: {sorted(ma)} vs {sorted(mb)}")
    findings += [f"step {s}: metrics differ" for s in sorted(set(ma) & set(mb)) if ma[s] != mb[s]]
    ca, cb = newest_checkpoint(a), newest_checkpoint(b)
    if ca.name != cb.name:
        findings.append(f"newest checkpoints differ: {ca.name} vs {cb.name}")
    shards = sorted(p.name for p in ca.glob("*.pt"))
    for name in shards:
        sa = torch.load(ca / name, map_location="cpu", weights_only=False)
        sb = torch.load(cb / name, map_location="cpu", weights_only=False)
        findings += [f"{name}{d}" for d in diff(sa, sb)]
    print(f"{len(ma)} steps, checkpoint {ca.name} ({len(shards)} shards) compared")
    for f in findings[:20]:
        print(f)
    print("same" if not findings else "DIFFERENT")
    return 0 if not findings else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
