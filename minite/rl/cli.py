"""`minite train CONFIG [--set key=value ...] [--fresh]`: check the config, run the RL loop, report.

Before anything is built (one-line failures through minite.cli): the config loads (keys, types, shapes), the files
it names exist, tp x pp and ep divide the processes started, the shape read from model.hf_config fits the precision
and layout, and the task fits the model. Output: one header line (model, precision, backend, devices, where output
goes), the progress bar, one summary line; every log record, upstream warnings included, goes to
LOGGING_DIR/train.log (rank r > 0: train.rank<r>.log).

Resume: the run continues from the newest checkpoint in checkpoint.dir when there is one (minite.rl.resume_policy
decides what the command line may change, and refuses a start that would mix two runs' checkpoints). `--fresh`
starts over instead and deletes what the earlier run left in these directories (checkpoints, metrics.jsonl, the
warm-up log, TensorBoard event files), so a later resume cannot pick them up. A run that starts from step 0 without
--fresh moves an earlier run's logs aside (minite.rl.loop.start_logs): nothing is deleted unasked.

Torch, Megatron-Core and the loop are imported inside run(): `minite --help` builds this parser and must stay fast.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import time
from pathlib import Path

from minite.cli_args import add_config_arguments
from minite.console import CONSOLE, attach_log_file

log = logging.getLogger(__name__)
SUMMARY_WINDOW = 5  # steps averaged at each end of the run for the reward in the summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--fresh", action="store_true",
                        help="start over: delete this run's checkpoints, metrics.jsonl, warm-up log and TensorBoard "
                             "files first (default: resume from the newest checkpoint in checkpoint.dir)")


def run(args: argparse.Namespace) -> int:
    from minite.config import check_paths, check_world_size, config_from_args

    cfg = config_from_args(args)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_paths(cfg)
    check_world_size(cfg, world)
    # before Megatron-Core is imported: its import-time warnings belong in the log file
    log_path = attach_log_file(Path(cfg.logging.dir) / ("train.log" if rank == 0 else f"train.rank{rank}.log"))
    check_model(cfg, world)
    if args.fresh:  # after every check: a run refused for its config deletes nothing
        if cfg.checkpoint.resume_from and rank == 0:
            log.warning("--fresh starts over: checkpoint.resume_from=%s is not read", cfg.checkpoint.resume_from)
        cfg.checkpoint.resume, cfg.checkpoint.resume_from = False, None
        if rank == 0:
            start_over(cfg)
    if rank == 0:
        print(header(cfg, world, log_path), flush=True)
    from minite.rl.loop import train

    t0 = time.perf_counter()
    history = train(cfg, fresh=args.fresh)
    if rank == 0:
        print(summary(cfg, history, time.perf_counter() - t0, log_path), flush=True)
    return 0


def check_model(cfg, world_size: int = 1) -> None:
    """The shape read from model.hf_config against precision and layout, and the task against the model;
    ConfigError naming the config."""
    from minite.config import ConfigError, check_model_shape
    from minite.learner.model import model_shape
    from minite.rl.loop import check_shapes
    from minite.rl.tasks import make_task

    try:
        if cfg.model.hf_config:
            check_model_shape(model_shape(cfg), cfg)
        check_shapes(cfg, make_task(cfg.rl.task, length=cfg.rl.task_length, num_digits=cfg.rl.task_digits),
                     world_size)
    except ValueError as e:
        raise ConfigError(f"{cfg.source or 'the config'}: {e}") from None


def start_over(cfg) -> None:
    """--fresh: remove the earlier run's checkpoints, metrics.jsonl, warm-up log and event files (module docstring);
    earlier runs' logs kept in previous_run_N/ (minite.rl.loop.start_logs) stay."""
    from minite.rl.loop import earlier_logs

    gone = []
    if cfg.checkpoint.dir and Path(cfg.checkpoint.dir).is_dir():
        for p in sorted(Path(cfg.checkpoint.dir).glob("step_*")):
            shutil.rmtree(p)
            gone.append(p.name)
    for p in earlier_logs(cfg.logging.dir):
        p.unlink()
        gone.append(p.name)
    if gone:
        log.info("--fresh: removed %s from the earlier run", ", ".join(gone), extra=CONSOLE)


def header(cfg, world: int, log_path: Path) -> str:
    import torch

    m = cfg.model
    model = (f"Qwen3-MoE from {m.hf_config}" if m.hf_config else f"Qwen3-MoE {m.num_layers} layers, hidden "
             f"{m.hidden_size}, {m.num_experts} experts top-{m.moe_router_topk}")
    precision = "NVFP4 W4A4" if cfg.precision.mode == "nvfp4" else "BF16"
    if cfg.alignment.strict:
        precision += ", strict"
    devices = (f"{world} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
               else f"CPU, {world} process{'es' if world > 1 else ''}")
    return (f"minite train: {model} | {precision} | rollout {cfg.rollout.backend} | {devices} | "
            f"output {cfg.logging.dir} (log {log_path.name})")


def summary(cfg, history: list[dict], seconds: float, log_path: Path) -> str:
    from minite.rl.checkpoint import latest_checkpoint

    where = [f"log {log_path}", f"metrics {Path(cfg.logging.dir) / 'metrics.jsonl'}"]
    if cfg.logging.tensorboard:
        where.append(f"TensorBoard {cfg.logging.dir}")
    newest = latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if newest is not None:
        where.append(f"checkpoint {newest}")
    if not history:
        return f"minite train: no RL step to run (rl.steps={cfg.rl.steps} reached)\n  output: " + ", ".join(where)
    k = min(SUMMARY_WINDOW, len(history))
    first = statistics.fmean(h["reward/mean"] for h in history[:k])
    last = statistics.fmean(h["reward/mean"] for h in history[-k:])
    gap = max(h["mismatch/logp_abs_max"] for h in history)
    return (f"minite train: done, {len(history)} RL steps in {seconds:.1f} s | reward {first:.3f} (first {k}) -> "
            f"{last:.3f} (last {k}) | max |logp gap| {gap:.2e}\n  output: " + ", ".join(where))
