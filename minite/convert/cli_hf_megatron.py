"""Arguments and entry points of `minite convert hf-to-megatron` and `minite convert megatron-to-hf`."""
from __future__ import annotations

import argparse
import sys

from minite.convert.safetensors_stream import ConversionError


def add_hf_to_megatron_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="output directory (must not hold a checkpoint)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (splits KV groups, vocab)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (splits experts)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (splits layers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_megatron_to_hf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron", required=True, help="a directory written by `minite convert hf-to-megatron`")
    p.add_argument("--out", required=True, help="output directory (must not hold a checkpoint)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _report(e: ConversionError) -> int:
    print(f"minite convert: error: {e}", file=sys.stderr)
    return 1


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    from minite.convert.hf_megatron import hf_to_megatron
    try:
        out = hf_to_megatron(args.hf, args.out, tp=args.tp, ep=args.ep, pp=args.pp, progress=not args.no_progress)
    except ConversionError as e:
        return _report(e)
    print(f"wrote {out}")
    return 0


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    from minite.convert.hf_megatron import megatron_to_hf
    try:
        out = megatron_to_hf(args.megatron, args.out, progress=not args.no_progress)
    except ConversionError as e:
        return _report(e)
    print(f"wrote {out}")
    return 0
