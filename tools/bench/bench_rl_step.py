"""One RL step of `minite train` timed by part: rollout, learner (log-probs + train), weight sync, and whole-loop
tokens/s, for one config (any precision, strict or not, one GPU or several under torchrun).

    python tools/bench/bench_rl_step.py CONFIG [--set k=v ...] --steps 5 --out docs/benchmarks/rl-step-h200.json
    torchrun --nproc-per-node 2 tools/bench/bench_rl_step.py CONFIG --set parallel.ep=2 --out ...   (EP=2)
    python tools/bench/bench_rl_step.py examples/tiny/nvfp4.yaml --steps 2 --out /tmp/rl-step.json      (CPU)

It builds the run as `minite train` does (warm-up included, checkpoints and logs off), runs --skip untimed steps
(the first steps pay one-off costs: kernel compilation, allocator growth), then --steps timed ones; each part is
the median over the timed steps of the loop's own time/* metrics (the loop synchronises the GPU around the weight
sync, so its copies are counted where they happen). Rank 0 merges one row into --out (the JSON keys `device`,
`date`, `commit`, `command`, `rows`; a row with the same gpus/layout/precision/strict/micro_batches is replaced), so
one file collects BF16/NVFP4, default/strict, rl.micro_batches, one GPU and EP=2 from separate invocations. On a GPU
a row also has the peak memory allocated on rank 0 over the whole run (`peak_mem_gib`, torch's allocator). Each row
also carries the `commit` and `date` it was measured at (the top-level ones are the last invocation's), and the table
shows them.

    python tools/bench/bench_rl_step.py --render docs/benchmarks/rl-step-h200.json     (the Markdown table for
                                                                                       docs/benchmarks.md)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl import loop
from provenance import commit  # tools/bench/, beside this script

ROW_KEYS = ("gpus", "layout", "precision", "strict", "micro_batches")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="YAML config, e.g. examples/h200/moe-nvfp4.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=5, help="timed RL steps (default 5)")
    p.add_argument("--skip", type=int, default=1, help="untimed RL steps first (default 1)")
    p.add_argument("--out", help="JSON file to merge the row into")
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a results file and exit")
    args = p.parse_args(argv)
    if args.render is None and (args.config is None or args.out is None):
        p.error("give CONFIG and --out (a measurement) or --render JSON (the table)")
    return args


def render(doc: dict) -> str:
    """docs/benchmarks.md's table of one results file (numbers are never typed by hand)."""
    out = [f"Device {doc['device']}, last invocation {doc['date']} at commit {doc['commit']}: `{doc['command']}`. "
           "Each row is one invocation's medians over its timed steps, measured at the commit it names.", "",
           "| gpus | layout | precision | strict | micro-batches | rollout s | learner s | sync s | step s | tokens/s "
           "| peak GiB | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(doc["rows"], key=lambda r: (r["gpus"], r["layout"], r["precision"], r["strict"],
                                                r.get("micro_batches", 1))):
        peak = r.get("peak_mem_gib")
        out.append(f"| {r['gpus']} | {r['layout']} | {r['precision']} | {'yes' if r['strict'] else 'no'} | "
                   f"{r.get('micro_batches', 1)} | {r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.3f} | "
                   f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {'-' if peak is None else f'{peak:.1f}'} | "
                   f"{r.get('commit', doc['commit'])} |")
    return "\n".join(out) + "\n"


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def measure(cfg, steps: int, skip: int) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = loop.setup(cfg)
    timed = []
    for i in range(skip + steps):
        m = loop.rl_step(run)
        if i >= skip:
            timed.append(m)
    if run.logger is not None:
        run.logger.close()
    med = lambda k: statistics.median(m[k] for m in timed)  # noqa: E731
    world = ckpt.rank_and_world()[1]
    par = cfg.parallel
    layout = "+".join(f"{k}{v}" for k, v in (("tp", par.tp), ("ep", par.ep), ("dp", world // (par.tp * par.pp)))
                      if v > 1) or "single"
    return {"gpus": world if torch.cuda.is_available() else 0, "layout": layout, "precision": cfg.precision.mode,
            "strict": bool(cfg.alignment.strict), "micro_batches": cfg.rl.micro_batches,
            "rollout_s": med("time/rollout_s"), "train_s": med("time/train_s"),
            "sync_s": med("time/sync_s"), "step_s": med("time/step_s"),
            "tokens_per_s": med("throughput/tokens_per_s"), "reward_mean": statistics.mean(m["reward/mean"]
                                                                                          for m in timed),
            "steps": steps,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


def merge(out: Path, row: dict, command: str) -> dict:
    doc = json.loads(out.read_text()) if out.exists() else {"rows": []}
    doc.update(device=device_name(), date=datetime.date.today().isoformat(), commit=commit(), command=command)
    row = {**row, "commit": doc["commit"], "date": doc["date"]}
    doc["rows"] = [r for r in doc["rows"] if any(r.get(k, 1 if k == "micro_batches" else None) != row[k]
                                                 for k in ROW_KEYS)] + [row]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    return doc


def main(argv=None) -> int:
    args = parse(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())), end="")
        return 0
    off = ["checkpoint.dir=null", "logging.tensorboard=false", "logging.progress_bar=false", "logging.dir=''"]
    cfg = load_config(args.config, off + args.overrides)
    row = measure(cfg, args.steps, args.skip)
    if ckpt.rank_and_world()[0] == 0:
        merge(Path(args.out), row, " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
