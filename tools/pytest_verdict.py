"""Whether a pytest run passed outright, from its output on stdin: exit 0 iff its summary line ("3 passed, 2 warnings
in 4.1s", with or without pytest's ===== frame) counts passed tests and warnings only (a skip, a failure, an error or
nothing collected is not a pass). The summary is the last such line, wherever it sits: output printed after pytest's
own (torch.distributed's "destroy_process_group() was not called" warning at exit, on the GPU machines) is ignored.
tools/gpu_acceptance.sh's gate stage judges each waiting kernel's GPU test with it.

    python3 -m pytest -q NODE 2>&1 | python3 tools/pytest_verdict.py
"""
import re
import sys

SUMMARY = re.compile(r"^=*\s*(\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s(?: \([\d:]+\))?\s*=*$")


def passed(output: str) -> bool:
    lines = [m[1] for m in map(SUMMARY.match, output.splitlines()) if m]
    if not lines:
        return False
    counts = {kind: int(n) for n, kind in (part.split(" ", 1) for part in lines[-1].split(", "))}
    return counts.get("passed", 0) > 0 and set(counts) <= {"passed", "warning", "warnings"}


if __name__ == "__main__":
    sys.exit(0 if passed(sys.stdin.read()) else 1)
