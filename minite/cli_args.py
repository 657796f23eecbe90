"""Arguments shared by the commands that read a config. Kept free of torch (and of minite.config, which imports it)
because `minite --help` builds every subcommand's parser."""
from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser, example: str = "examples/tiny/nvfp4.yaml") -> None:
    """The config as a positional argument or as --config (every command accepts both), and --set; read them with
    minite.config.config_from_args."""
    parser.add_argument("config", nargs="?", default=None, help=f"YAML config, e.g. {example}")
    parser.add_argument("--config", dest="config_option", default=None, metavar="CONFIG",
                        help="the same, as an option")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set rl.steps=5 (repeatable; a relative path given here "
                             "is relative to the current directory)")
