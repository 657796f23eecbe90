"""`minite diagnose [CONFIG | --config CONFIG] --a learner --b embedded|sglang [--json OUT] [--fail-above GAP]`.

Before anything is built (one-line failures through minite.cli): the numeric arguments are in range, --json names a
file in an existing directory, the config loads and the files it names exist, and the longest sequence
(--max-prompt-len + --max-new-tokens) fits model.max_position_embeddings, the check `minite train` makes.
Log records (upstream warnings included) go to LOGGING_DIR/diagnose.log; the terminal gets the report
(minite.console). Config and engines are imported inside run(): `minite --help` builds this parser.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from minite.cli_args import add_config_arguments
from minite.console import attach_log_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--a", default="learner", choices=["learner"], help="reference engine")
    parser.add_argument("--b", default="embedded", choices=["embedded", "sglang"], help="engine under test")
    parser.add_argument("--json", dest="json_out", default=None, help="write the full report here")
    parser.add_argument("--fail-above", type=float, default=None, metavar="GAP",
                        help="exit with status 1 when max |logp gap| exceeds GAP")
    parser.add_argument("--prompts", type=int, default=8, help="number of prompts (varied lengths)")
    parser.add_argument("--max-new-tokens", type=int, default=6,
                        help="tokens each engine generates per prompt; their log-probs are compared")
    parser.add_argument("--max-prompt-len", type=int, default=9, help="prompt lengths are drawn from 2..this")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts and of sampling (the same seed gives the same comparison)")


def check_arguments(args: argparse.Namespace, params) -> None:
    """ConfigError for a numeric argument out of range or a --json path that cannot be written (module docstring)."""
    from minite.config import ConfigError

    for flag, value, low in (("--prompts", params.num_prompts, 1), ("--max-new-tokens", params.max_new_tokens, 1),
                             ("--max-prompt-len", params.max_prompt_len, params.min_prompt_len)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.fail_above is not None and not math.isfinite(args.fail_above):
        raise ConfigError(f"--fail-above must be a finite number, got {args.fail_above}")
    if args.json_out:
        out = Path(args.json_out)
        if out.is_dir():
            raise ConfigError(f"--json {out} is a directory: name a file in it, e.g. {out / 'diagnose.json'}")
        if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise ConfigError(f"--json {out}: {out.parent} is not a directory this process can write to")


def check_sequence_length(cfg, params) -> None:
    """ConfigError when the longest sequence does not fit model.max_position_embeddings (of model.hf_config when
    set), or the shape read from model.hf_config does not fit the precision and layout: `minite train`'s checks."""
    from minite.config import ConfigError, check_model_shape
    from minite.models.qwen3_moe import Qwen3MoeShape

    try:
        shape = Qwen3MoeShape.from_any(cfg.model.hf_config or cfg.model)
        if cfg.model.hf_config:
            check_model_shape(shape, cfg)
    except ValueError as e:
        raise ConfigError(f"{cfg.source or 'the config'}: {e}") from None
    need = params.max_prompt_len + params.max_new_tokens
    if need > shape.max_position_embeddings:
        raise ConfigError(f"--max-prompt-len {params.max_prompt_len} + --max-new-tokens {params.max_new_tokens} "
                          f"exceeds model.max_position_embeddings={shape.max_position_embeddings}: lower them")


def run(args: argparse.Namespace) -> int:
    from minite.config import check_paths, config_from_args
    from minite.alignment.diagnose import DiagnoseParams, format_report, run_diagnose

    params = DiagnoseParams(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            max_prompt_len=getattr(args, "max_prompt_len", 9))  # namespaces built by callers
    check_arguments(args, params)
    cfg = config_from_args(args)
    check_paths(cfg)
    check_sequence_length(cfg, params)
    attach_log_file(Path(cfg.logging.dir) / "diagnose.log")
    report = run_diagnose(cfg, b=args.b, params=params)
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if args.fail_above is not None and report["max_abs_logp_gap"] > args.fail_above:
        print(f"minite diagnose: max |logp gap| {report['max_abs_logp_gap']:.3e} > {args.fail_above:.3e}")
        return 1
    return 0
