"""Where a benchmark's numbers come from, for its JSON: the commit, the date and the command.

The commit is MINITE_COMMIT when the caller sets it, else git's HEAD, marked `+dirty` when tracked files differ from
it. A device's copy of the tree can carry git metadata older than its files (in the twelfth session a kernels JSON
measured at 7693d02 said f3e5b6f): the mark shows that instead of naming the wrong commit silently. A run with
MINITE_TRY_KERNELS set (minite/strict/fused.py: kernels routed before their GPU test has passed) says so too: the
commit reads `abc1234+MINITE_TRY_KERNELS=expert_swiglu`, since that commit alone does not run what was measured.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE, check=True).stdout.strip()


def commit() -> str:
    tried = ",".join(sorted({n.strip() for n in os.environ.get("MINITE_TRY_KERNELS", "").split(",") if n.strip()}))
    tried = f"+MINITE_TRY_KERNELS={tried}" if tried else ""
    if os.environ.get("MINITE_COMMIT"):
        return os.environ["MINITE_COMMIT"] + tried
    try:
        head = _git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "") + tried
    except (OSError, subprocess.CalledProcessError):
        return "unknown" + tried


def stamp() -> dict:
    """{"date", "commit", "command"} of this run (UTC, the commit as `commit()`, the command line as run)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "command": "python3 " + " ".join(sys.argv)}


def emit(result: dict, out: str | None) -> None:
    """Print a benchmark's result as one JSON line, and write it (indented) to `out` when given."""
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def save(doc: dict, out: str) -> None:
    """Write a benchmark's JSON (indented, a final newline) to `out`."""
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
