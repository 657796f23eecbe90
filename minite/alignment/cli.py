"""`minite diagnose [CONFIG | --config CONFIG] --a learner --b embedded|sglang [--json OUT] [--fail-above GAP]`.

Log records (upstream warnings included) go to LOGGING_DIR/diagnose.log; the terminal gets the report
(minite.console). Config and engines are imported inside run(): `minite --help` builds this parser.
"""
from __future__ import annotations

import argparse
import json
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


def run(args: argparse.Namespace) -> int:
    from minite.config import check_paths, config_from_args
    from minite.alignment.diagnose import DiagnoseParams, format_report, run_diagnose

    cfg = config_from_args(args)
    check_paths(cfg)
    attach_log_file(Path(cfg.logging.dir) / "diagnose.log")
    params = DiagnoseParams(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            max_prompt_len=getattr(args, "max_prompt_len", 9))  # namespaces built by callers
    report = run_diagnose(cfg, b=args.b, params=params)
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if args.fail_above is not None and report["max_abs_logp_gap"] > args.fail_above:
        print(f"minite diagnose: max |logp gap| {report['max_abs_logp_gap']:.3e} > {args.fail_above:.3e}")
        return 1
    return 0
