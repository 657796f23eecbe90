"""`minite bench [ARGS...]`: run the NVFP4 kernel benchmark driver (tools/bench/bench_nvfp4.py) and print its table.

The driver lives in the repository's tools/ folder (it is not part of the installed package), so this works from a
source checkout (the README's editable install). It needs a CUDA GPU; results go to --out as JSON (default DEFAULT_OUT
under the current directory: the driver's own default is the tracked docs/benchmarks/kernels-h200.json, which only a
deliberate `--out docs/benchmarks/kernels-h200.json` should replace) and `tools/bench/render_benchmarks.py` turns them
into docs/benchmarks.md. Every option after `bench` goes to the driver (minite.cli passes unknown options through).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[1] / "tools" / "bench" / "bench_nvfp4.py"
DEFAULT_OUT = "runs/bench/kernels.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="passed to tools/bench/bench_nvfp4.py (e.g. --sections quant,decode --out FILE; "
                             f"--out defaults to {DEFAULT_OUT})")


def driver_arguments(args: list[str]) -> tuple[list[str], Path]:
    """The driver's command line and its output file: `args` with --out made absolute (the driver runs in the
    checkout, the user's relative path means the current directory), --out DEFAULT_OUT when none is given."""
    argv, out = list(args), None
    for i, a in enumerate(argv):
        if a.startswith("--out="):
            out = Path(a.split("=", 1)[1]).absolute()
            argv[i] = f"--out={out}"
        elif a == "--out" and i + 1 < len(argv):
            out = Path(argv[i + 1]).absolute()
            argv[i + 1] = str(out)
    if out is None:
        out = Path(DEFAULT_OUT).absolute()
        argv += ["--out", str(out)]
    return argv, out


def run(args: argparse.Namespace) -> int:
    import torch

    if not DRIVER.exists():
        print(f"minite bench: {DRIVER} not found; run from a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("minite bench: the kernel benchmarks need a CUDA GPU (none found); docs/benchmarks.md has H200 results",
              file=sys.stderr)
        return 2
    argv, out = driver_arguments(args.args)
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.call([sys.executable, str(DRIVER), *argv], cwd=DRIVER.parents[2])
