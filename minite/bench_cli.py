"""`minite bench [ARGS...]`: run the NVFP4 kernel benchmark driver (tools/bench/bench_nvfp4.py) and print its table.

The driver lives in the repository's tools/ folder (it is not part of the installed package), so this works from a
source checkout (the README's editable install). It needs a CUDA GPU; results go to --out as JSON
(default docs/benchmarks/kernels-h200.json) and `tools/bench/render_benchmarks.py` turns them into docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[1] / "tools" / "bench" / "bench_nvfp4.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="passed to tools/bench/bench_nvfp4.py (e.g. --sections quant,decode --out FILE)")


def run(args: argparse.Namespace) -> int:
    import torch

    if not DRIVER.exists():
        print(f"minite bench: {DRIVER} not found; run from a source checkout (pip install -e .)")
        return 2
    if not torch.cuda.is_available():
        print("minite bench: the kernel benchmarks need a CUDA GPU (none found); docs/benchmarks.md has H200 results")
        return 2
    return subprocess.call([sys.executable, str(DRIVER), *args.args], cwd=DRIVER.parents[2])
