"""`minite train CONFIG [--set key=value ...]`: load the config and run the RL loop."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config, e.g. examples/tiny/nvfp4.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set rl.steps=5 (repeatable)")


def run(args: argparse.Namespace) -> int:
    from minite.config import load_config_for_cli

    cfg = load_config_for_cli("minite train", args.config, args.overrides)
    if cfg is None:
        return 2
    from minite.rl.checkpoint import CheckpointError
    from minite.rl.loop import train
    try:
        train(cfg)
    except CheckpointError as e:
        print(f"minite train: {e}")
        return 2
    return 0
