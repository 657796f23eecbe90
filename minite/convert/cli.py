"""`minite convert <what>`: one sub-subcommand per conversion, dispatched through CONVERTERS.

To add one, append `name: (module, help)` to CONVERTERS; the module exposes `add_<name>_arguments(parser)` and
`run_<name>(args)` with dashes in `name` written as underscores (e.g. add_export_nvfp4_arguments, run_export_nvfp4).
A module that is not importable yet leaves its command listed but answering "not available".
"""
from __future__ import annotations

import argparse
import importlib
import sys

CONVERTERS = {
    "hf-to-megatron": ("minite.convert.cli_hf_megatron",
                       "Hugging Face Qwen3-MoE safetensors -> the learner's per-rank Megatron checkpoint"),
    "megatron-to-hf": ("minite.convert.cli_hf_megatron",
                       "a checkpoint from hf-to-megatron -> Hugging Face sharded safetensors with an index"),
}


def _fn(name: str, kind: str) -> str:
    return f"{kind}_{name.replace('-', '_')}" if kind == "run" else f"add_{name.replace('-', '_')}_arguments"


def _module(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="convert_command", metavar="{" + ",".join(CONVERTERS) + "}")
    for name, (module, help_text) in CONVERTERS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_convert_module=module, _convert_name=name)
        mod = _module(module)
        if mod is not None:
            getattr(mod, _fn(name, "add"))(sub)


def run(args: argparse.Namespace) -> int:
    name = getattr(args, "convert_command", None)
    if name is None:
        print("minite convert: name a conversion: " + ", ".join(CONVERTERS), file=sys.stderr)
        return 2
    mod = _module(args._convert_module)
    if mod is None:
        print(f"minite convert {name}: not available in this build ({args._convert_module} is missing)",
              file=sys.stderr)
        return 2
    return int(getattr(mod, _fn(name, "run"))(args) or 0)
