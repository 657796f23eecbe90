"""`minite convert <what>`: one sub-subcommand per conversion, dispatched through CONVERTERS.

CONVERTERS maps a name to (help, add_arguments, run). add_arguments(parser) and run(args) -> exit code are callables
or "module:function" strings, imported only when used, so `minite --help` does not import torch. To add a
conversion, add one entry. A module that is not importable yet leaves its command listed but answering
"not available". A run raises ConversionError (safetensors_stream; export_nvfp4.ExportError is one) for whatever the
user can fix: minite/cli.py reports it as one line with exit status 2, any other exception as an unexpected one (1).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Union

Fn = Union[Callable, str]


def _add_hf_to_megatron(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="output directory (created; must not exist or be empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (splits KV groups and vocabulary)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (splits experts)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (splits layers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_megatron_to_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron", required=True, help="a directory written by `minite convert hf-to-megatron`")
    p.add_argument("--out", required=True, help="output directory (created; must not exist or be empty)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


CONVERTERS: dict[str, tuple[str, Fn, Fn]] = {
    "hf-to-megatron": ("Hugging Face Qwen3-MoE safetensors -> the learner's per-rank Megatron checkpoint",
                       _add_hf_to_megatron, "minite.convert.hf_megatron:run_hf_to_megatron"),
    "megatron-to-hf": ("a checkpoint from hf-to-megatron -> Hugging Face sharded safetensors with an index",
                       _add_megatron_to_hf, "minite.convert.hf_megatron:run_megatron_to_hf"),
    "export-nvfp4": ("a Qwen3-MoE checkpoint (HF or hf-to-megatron's) -> HF safetensors in ModelOpt's NVFP4 naming",
                     "minite.convert.export_nvfp4:add_arguments", "minite.convert.export_nvfp4:run"),
}


def _resolve(fn: Fn):
    """A callable, or None when its module is not importable (not in this build yet)."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="convert_command", metavar="{" + ",".join(CONVERTERS) + "}")
    for name, (help_text, add, _run) in CONVERTERS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        adder = _resolve(add)
        if adder is not None:
            adder(sub)
        else:
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    name = getattr(args, "convert_command", None)
    if name is None:
        print("minite convert: name a conversion: " + ", ".join(CONVERTERS), file=sys.stderr)
        return 2
    runner = _resolve(CONVERTERS[name][2])
    if runner is None:
        print(f"minite convert {name}: not available in this build ({CONVERTERS[name][2]} is missing)",
              file=sys.stderr)
        return 2
    return int(runner(args) or 0)
