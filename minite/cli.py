"""The `minite` command: train, diagnose, convert, bench.

Environment variables are read here and nowhere else in the library:
- MINITE_LOG_LEVEL (default INFO).
- TORCHDYNAMO_DISABLE: set to 1 on machines without a GPU unless already set (Megatron's jit_fuser is
  torch.compile, whose compile time dominates a tiny CPU run).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

SUBCOMMANDS = {
    # name: (module with add_arguments(parser) and run(args), one-line help)
    "train": ("minite.rl.cli", "run the RL loop from a YAML config (e.g. examples/tiny/nvfp4.yaml)"),
    "diagnose": ("minite.alignment.cli", "compare two engines op by op and report where their log-probs diverge"),
    "convert": ("minite.convert.cli", "convert checkpoints: hf-to-megatron, megatron-to-hf, export-nvfp4"),
    "bench": ("minite.bench_cli", "run a benchmark from tools/bench and print its table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minite", description="miniTE: RL of LLMs in native NVFP4 (W4A4).")
    subs = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        mod = _try_import(module)
        if mod is not None:
            mod.add_arguments(sub)
        else:
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _try_import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def _configure_environment() -> None:
    logging.basicConfig(level=os.environ.get("MINITE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = _try_import(args._module)
    if mod is None:
        print(f"minite {args.command}: not available in this build yet ({args._module} is missing)", file=sys.stderr)
        return 2
    _configure_environment()
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
