"""What a resumed run takes from its checkpoint and what from the command line.

The checkpoint holds the run's state (weights, optimizer moments, RNG, data position) and the config it was saved
with (`config_for_checkpoint`, stored under "config"). On resume the current config wins for everything that can
change mid-run (learning rate and the other optimizer hyperparameters, rl.steps, clipping, the KL coefficient,
logging, checkpointing, alignment thresholds), and the log names every value that differs from the checkpoint's.
What the saved state cannot follow stops the run with a ConfigError naming the key, the two values and the way out
(FROZEN): the model's shape, the precision, the parallel layout; the prompt stream's seed and batch size (its saved
position counts batches of that stream); and a KL penalty raised from 0, since a run without one kept no reference
policy to measure it against.

A run starts from one step and saves its checkpoints into checkpoint.dir: one that starts before a checkpoint already
there (resuming from an older one with checkpoint.resume_from, or from scratch with checkpoint.resume=false) would
leave two runs' checkpoints side by side, and the next resume would pick the other run's newest. `refuse_mixed_runs`
stops it before anything is built.

The learner applies the optimizer hyperparameters after loading the optimizer state (Learner.load_state_dict), since
the state's param groups carry the old learning rate.
"""
from __future__ import annotations

import logging
from typing import Any

from minite.config import Config, ConfigError, to_dict
from minite.console import CONSOLE
from minite.rl import checkpoint as ckpt

log = logging.getLogger(__name__)

FROZEN = {
    "model.": "the model shape",
    "precision.": "the precision",
    "parallel.": "the parallel layout",
    "rl.seed": "the prompt stream (its saved position counts the checkpoint's batches)",
    "rl.prompts_per_step": "the prompt stream (its saved position counts the checkpoint's batches)",
}
"""Dotted keys (or section prefixes) a resumed run cannot change, each with what it would break."""
IGNORED = ("source", "model.init_from", "model.hf_config", "checkpoint.resume", "checkpoint.resume_from",
           "checkpoint.dir", "logging.dir")
"""Neither saved nor compared: where the config came from, the initial weights and the shape file (the checkpoint's
weights replace them; a path may be spelled differently from another directory), how the checkpoint was found, and
where the run writes. None of them is part of the run's state, so a run resumed from a copy of its checkpoints in
another directory saves exactly what the uninterrupted run saves."""


def config_for_checkpoint(cfg: Config) -> dict:
    """The config as plain data (lists, numbers, strings; loadable with torch.load(weights_only=True)), without the
    IGNORED keys."""
    out = to_dict(cfg)
    for key in IGNORED:
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


ADDED = {"rl.micro_batches": 1}
"""Keys added to the config after checkpoints existed, each with the value that stands for how the code behaved
before it (what a checkpoint without the key ran with)."""


def config_changes(saved: dict, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (checkpoint's value, current value)} for every compared key that differs; a key of ADDED that
    the checkpoint lacks counts as its ADDED value there."""
    saved, new = _flatten(saved), _flatten(to_dict(cfg))
    old = {**ADDED, **saved}
    keys = (set(saved) | set(new)) - set(IGNORED)
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


def check_resume(state: dict, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Apply the policy (module docstring) to a loaded checkpoint `state`; returns the changes."""
    step = int(state["step"])
    where = cfg.checkpoint.resume_from or f"in {cfg.checkpoint.dir}"
    if step > cfg.rl.steps:
        raise ConfigError(f"the checkpoint {where} is at step {step}, past rl.steps={cfg.rl.steps}: raise rl.steps to "
                          "continue it, or start over with `minite train CONFIG --fresh` (or another checkpoint.dir)")
    saved = state.get("config")
    if not isinstance(saved, dict):
        log.warning("the checkpoint %s carries no config: the current one is used as is", where)
        return {}
    changes = config_changes(saved, cfg)
    for k, (a, b) in changes.items():
        what = next((why for key, why in FROZEN.items() if k == key or (key.endswith(".") and k.startswith(key))),
                    None)
        if what is not None:
            raise ConfigError(f"{k} is {a!r} in the checkpoint {where} but {b!r} now: a resumed run cannot change "
                              f"{what}; put it back, or start over with --fresh (or another checkpoint.dir)")
    if cfg.rl.kl_coef > 0 and state.get("ref") is None:
        raise ConfigError(f"rl.kl_coef is {cfg.rl.kl_coef:g} but the checkpoint {where} was saved by a run without a "
                          "KL penalty, which kept no reference policy: keep rl.kl_coef=0 for this run, or start over "
                          "with --fresh (or another checkpoint.dir)")
    text = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    log.info("resuming from the checkpoint %s at step %d%s", where, step,
             f"; changed since then: {text}" if text else "", extra=CONSOLE)
    return changes


def refuse_mixed_runs(cfg: Config) -> None:
    """ConfigError when checkpoint.dir holds a checkpoint newer than the step this run starts from (module
    docstring). The step is checkpoint.resume_from's (its manifest, read first: a missing or incomplete one is a
    CheckpointError), or 0 with checkpoint.resume=false; a run that resumes from checkpoint.dir's newest intact
    checkpoint starts after everything there but corrupt ones, which it names and replaces. Call before the run is
    built."""
    c = cfg.checkpoint
    start = ckpt.read_manifest(c.resume_from)["step"] if c.resume_from else 0
    if not c.dir or (c.resume and not c.resume_from):
        return
    newer = [p for p in ckpt.checkpoints_newest_first(c.dir) if ckpt.step_of(p) > start]
    if not newer:
        return
    if c.resume_from:
        why = f"checkpoint.resume_from={c.resume_from} is at step {start}"
        other = "; to continue the run they belong to, drop checkpoint.resume_from (--set checkpoint.resume_from=null)"
    else:
        why, other = "checkpoint.resume=false starts at step 0", ", or delete them with --fresh"
    raise ConfigError(f"checkpoint.dir={c.dir} holds {len(newer)} checkpoint(s) after step {start} (the newest: "
                      f"{newer[0].name}), and {why}: this run's checkpoints would mix with those, and a later resume "
                      "would take their newest. Move them out of checkpoint.dir, or write this run elsewhere "
                      f"(--set checkpoint.dir=ANOTHER_DIR --set logging.dir=ANOTHER_DIR){other}")
