"""The `minite` command: train, diagnose, convert, bench.

Failures: a problem the user can fix (USER_ERRORS: a bad config, a missing or corrupt checkpoint, a conversion made
for another layout, SGLang missing, the alignment monitor's stop, a run that diverged to NaN or Inf or ran out of
memory) is one line "minite CMD: <cause and fix>" on stderr and exit status 2; Ctrl-C is one line and status 130;
anything else is one line naming the exception (status 1) and its traceback goes to the run's log file. `--debug`
(or MINITE_DEBUG=1) prints the traceback as well. The classes are matched by name along the exception's MRO: they
live in modules that import torch and Megatron-Core, which `minite --help` must not pay for, and the name is what the
message shows anyway.

Output: quiet by default (minite.console); `-v` shows every log record on the terminal.

Environment variables are read here and nowhere else in the library:
- MINITE_LOG_LEVEL (default INFO): the level of the log file (and of the terminal with -v).
- MINITE_DEBUG=1: as --debug.
- TORCHDYNAMO_DISABLE: set to 1 on machines without a GPU unless already set (Megatron's jit_fuser is
  torch.compile, whose compile time dominates a tiny CPU run).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from minite import __version__
from minite.console import catch_interrupts, configure, one_line, raise_if_interrupted

log = logging.getLogger(__name__)

SUBCOMMANDS = {
    # name: (module with add_arguments(parser) and run(args), one-line help)
    "train": ("minite.rl.cli", "run the RL loop from a YAML config (e.g. examples/tiny/nvfp4.yaml)"),
    "diagnose": ("minite.alignment.cli", "compare two engines op by op and report where their log-probs diverge"),
    "convert": ("minite.convert.cli", "convert checkpoints: hf-to-megatron, megatron-to-hf, export-nvfp4"),
    "bench": ("minite.bench_cli", "run a benchmark from tools/bench and print its table"),
}
PASSTHROUGH = {"bench"}  # subcommands whose unknown options go on to the program they run (args.args)
USER_ERRORS = frozenset({"ConfigError", "CheckpointError", "ConversionError", "SGLangVersionError",
                         "SGLangUnavailableError", "AlignmentError", "DivergedError", "OutOfMemoryRunError"})
EXIT_USER, EXIT_INTERRUPTED = 2, 130


def _add_common(parser: argparse.ArgumentParser, default) -> None:
    """-v and --debug, accepted before and after the subcommand (a subcommand's default must not undo the top's)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="show every log record (upstream warnings, INFO) on the terminal, not only in the log "
                             "file")
    parser.add_argument("--debug", action="store_true", default=default,
                        help="print the traceback of a failure (also MINITE_DEBUG=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minite", description="miniTE: RL of LLMs in native NVFP4 (W4A4).")
    parser.add_argument("--version", action="version", version=f"minite {__version__}")
    _add_common(parser, False)
    subs = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _add_common(sub, argparse.SUPPRESS)
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


def _configure_environment(verbose: bool) -> None:
    configure(verbose)
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def is_user_error(e: BaseException) -> bool:
    return any(cls.__name__ in USER_ERRORS for cls in type(e).__mro__)


def report_failure(prog: str, e: BaseException, debug: bool) -> int:
    """One line on stderr for `e` (module docstring); the traceback to the log file, and to stderr with debug."""
    if debug:
        traceback.print_exception(e)
    if isinstance(e, KeyboardInterrupt):
        log.info("interrupted", exc_info=e)
        print(f"{prog}: interrupted (Ctrl-C); run the same command again to resume from the newest checkpoint",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    log.info("failed", exc_info=e)  # INFO: the log file (and the terminal only with -v)
    if is_user_error(e):
        print(f"{prog}: {one_line(e)}", file=sys.stderr)
        return EXIT_USER
    hint = "" if debug else "; run with --debug for the traceback"
    print(f"{prog}: unexpected {type(e).__name__}: {one_line(e)}{hint}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.args = extra + list(getattr(args, "args", []))
    if args.command is None:
        parser.print_help()
        return EXIT_USER
    mod = _try_import(args._module)
    if mod is None:
        print(f"minite {args.command}: not available in this build yet ({args._module} is missing)", file=sys.stderr)
        return EXIT_USER
    debug = args.debug or os.environ.get("MINITE_DEBUG") == "1"
    prog = f"minite {args.command}"
    catch_interrupts()
    try:
        _configure_environment(args.verbose)
        status = int(mod.run(args) or 0)
        raise_if_interrupted()  # a Ctrl-C that a library swallowed (minite.console) still ends as one
        return status
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the one place a failure becomes an exit status
        return report_failure(prog, e, debug)


if __name__ == "__main__":
    sys.exit(main())
