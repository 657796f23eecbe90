"""The RL loop: rollout -> reward -> advantages -> train -> sync weights -> log, once per step.

    train(cfg)
      setup: Learner (BF16 or NVFP4 Megatron GPTModel + Adam), rollout engine over the same layers,
             task + prompt stream; then either resume from the newest checkpoint or run the optional
             supervised warm-up; push the learner's weights to the engine.
      each step:
        problems   = next batch of prompts                     (PromptStream: a function of seed, step)
        rollouts   = engine.generate(prompts, n=group_size)    (tokens + the engine's log-probs)
        rewards    = task.reward(problem, response)            (exact, in [0, 1])
        advantages = group-normalised rewards                  (grpo.group_advantages)
        train      = learner log-probs before the update (old_logp, and the mismatch metrics against
                     the engine's), then rl.minibatches optimizer steps on the GRPO loss (each over rl.micro_batches chunks)
        sync       = engine.update_weights(learner.named_weights())
        log        = TensorBoard + JSONL + progress bar; checkpoint every checkpoint.every steps

Sequences are right-padded: tokens [N, T] = prompt + response + <pad>; the learner returns
log p(tokens[:, t+1] | tokens[:, :t+1]) as [N, T-1], so response token k of a row whose prompt has
P tokens sits at column P - 1 + k. `mask` marks exactly those columns; padding never enters a loss.

Determinism: the rollout seed of step s is mix_seed(rl.seed, s) and engines never use the global
RNG, so a resumed run repeats an uninterrupted one exactly (checkpoint.py lists what is saved).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minite.alignment.monitor import check_gap
from minite.console import raise_if_interrupted
from minite.alignment.routing_replay import engine_recording, learner_replay
from minite.learner.learner import Learner, ReferencePolicy, reference_policy
from minite.nvfp4.device_copy import host_to
from minite.rl import checkpoint as ckpt
from minite.rl.failures import CHECKPOINT_TOO_BIG, MODEL_TOO_BIG, stop_cleanly
from minite.rl.grpo import GRPOParams, group_advantages, grpo_loss
from minite.rl.metrics import WARMUP_RUN, MetricsLogger, check_finite, mismatch_metrics, rollout_metrics
from minite.rl.ranks import rank0_rollouts
from minite.rl.resume_policy import check_resume, config_for_checkpoint, refuse_mixed_runs
from minite.rl.tasks import PAD, DigitTask, Problem, PromptStream, make_task, mix_seed
from minite.rollout import make_engine
from minite.rollout.base import RolloutEngine, RolloutResult, SamplingParams

log = logging.getLogger(__name__)
WARMUP_SEED_OFFSET = 1_000_003  # the warm-up stream must not replay the RL prompts
WARMUP_LOG = "warmup.jsonl"  # beside metrics.jsonl: the warm-up steps' rows


@dataclass
class Batch:
    tokens: torch.Tensor  # [N, T] long, right-padded with PAD
    mask: torch.Tensor  # [N, T-1] float, 1 on response-token columns
    rollout_logp: torch.Tensor  # [N, T-1] fp32, the engine's log-probs on mask, 0 elsewhere
    num_tokens: int  # real (unpadded) tokens, prompt + response, over all rows


@dataclass
class Run:
    cfg: Any
    learner: Any
    engine: RolloutEngine
    task: DigitTask
    stream: PromptStream
    grpo: GRPOParams
    ref: ReferencePolicy | None = None  # the frozen KL reference when rl.kl_coef > 0
    step: int = 0
    history: list[dict] = field(default_factory=list)
    logger: MetricsLogger | None = None


def train(cfg, *, fresh: bool = False) -> list[dict]:
    """Run cfg.rl.steps RL steps (resuming if a checkpoint exists); returns the per-step metrics. fresh: `minite
    train --fresh`, whose rank 0 empties checkpoint.dir while the other ranks start (`setup`)."""
    with stop_cleanly(cfg, "while building the run", memory_fix=MODEL_TOO_BIG):
        run = setup(cfg, fresh=fresh)
    if run.step >= cfg.rl.steps:
        log.warning("checkpoint at step %d already reaches rl.steps=%d: nothing to do (raise rl.steps, or start "
                    "over with --fresh or another checkpoint.dir)", run.step, cfg.rl.steps)
    try:
        while run.step < cfg.rl.steps:
            raise_if_interrupted()  # a Ctrl-C swallowed during start-up (minite.console) stops the run here
            with stop_cleanly(cfg, f"at RL step {run.step + 1} of {cfg.rl.steps}"):
                rl_step(run)
    finally:
        if run.logger is not None:
            run.logger.close()
        shutdown_engines(run)
    return run.history


def shutdown_engines(run: Run) -> None:
    """Stop engines that run outside this process (SGLang's scheduler) and remove their files; idempotent."""
    for engine in (run.engine, run.ref):
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def rl_step(run: Run) -> dict:
    cfg, t0 = run.cfg, _device_time()
    problems = run.stream.next_batch()
    with engine_recording(run.engine, cfg.alignment.routing_replay) as rec:  # expert routes, to replay
        rollouts = run.engine.generate([p.prompt for p in problems], sampling_params(cfg, run.step, run.task))
    routes = None if rec is None else rec.routes(len(rollouts))
    rollouts, routes, rows_differ = rank0_rollouts(rollouts, routes)  # every rank trains on rank 0's batch
    t_rollout = time.perf_counter() - t0
    rewards = score(run.task, problems, rollouts, cfg.rollout.group_size)
    advantages = group_advantages(rewards, cfg.rollout.group_size)
    batch = make_batch(rollouts)
    t_train = time.perf_counter()
    metrics = train_on_batch(run, batch, advantages, routes)
    t_sync = _device_time()
    sync_weights(run)
    run.step += 1
    t_end = _device_time()
    elapsed = t_end - t0
    metrics.update(rollout_metrics(rewards, batch.rollout_logp, batch.mask))
    if rows_differ is not None:
        metrics["rollout/rows_differ"] = rows_differ
    metrics.update({"throughput/tokens_per_s": batch.num_tokens / elapsed,
                    "time/step_s": elapsed, "time/rollout_s": t_rollout, "time/train_s": t_sync - t_train,
                    "time/sync_s": t_end - t_sync})
    log_step(run, metrics)
    maybe_checkpoint(run)
    return metrics


def _device_time() -> float:
    """perf_counter after the GPU's queued work (weight copies are asynchronous): the step's time split is real."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def sampling_params(cfg, step: int, task: DigitTask) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        n=cfg.rollout.group_size,
        seed=mix_seed(cfg.rl.seed, step),
        stop_token_id=task.tokenizer.eos_id,
    )


def score(task: DigitTask, problems: list[Problem], rollouts: list[RolloutResult], n: int) -> torch.Tensor:
    if len(rollouts) != len(problems) * n:
        raise RuntimeError(f"engine returned {len(rollouts)} rollouts for {len(problems)} prompts x {n}")
    return torch.tensor([task.reward(problems[r.prompt_index], r.tokens) for r in rollouts], dtype=torch.float32)


def make_batch(rollouts: list[RolloutResult]) -> Batch:
    """Right-pad prompt + response rows; place the engine's log-probs on the response columns."""
    rows = [r.prompt + r.tokens for r in rollouts]
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    rollout_logp = torch.zeros(len(rows), width - 1)
    for i, (r, row) in enumerate(zip(rollouts, rows)):
        tokens[i, : len(row)] = torch.tensor(row)
        start, n = len(r.prompt) - 1, len(r.tokens)
        mask[i, start : start + n] = 1
        rollout_logp[i, start : start + n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return Batch(tokens, mask, rollout_logp, sum(len(row) for row in rows))


def train_on_batch(run: Run, batch: Batch, advantages: torch.Tensor, routes=None) -> dict:
    """Mismatch metrics from the learner's pre-update log-probs (alignment monitor: warn/stop), then
    rl.minibatches GRPO steps; with `routes` (alignment.routing_replay) the learner replays the engine's experts."""
    cfg, seq_len = run.cfg, batch.tokens.shape[1]
    with _replay(run.learner, routes, seq_len, list(range(batch.tokens.shape[0]))):
        learner_logp = run.learner.logprobs(batch.tokens).float()
    metrics = mismatch_metrics(learner_logp.cpu(), batch.rollout_logp, batch.mask)  # host metrics, [N, T-1]
    check_gap(metrics, cfg.alignment, run.step)
    old_logp = learner_logp if cfg.rl.old_logp_source == "learner" else batch.rollout_logp
    ref_logp = run.ref.logprobs(batch.tokens).float() if run.ref is not None else None
    parts: list[dict] = []
    n = cfg.rl.micro_batches
    for rows in torch.arange(batch.tokens.shape[0]).chunk(cfg.rl.minibatches):
        tokens = float(batch.mask[rows].sum()) if n > 1 else None  # each chunk's loss: its share of the minibatch's

        def chunk_loss(logp, part, tokens=tokens):
            return grpo_loss(
                logp, old_logp.index_select(0, host_to(part, old_logp.device)), advantages[part], batch.mask[part],
                run.grpo, rollout_logp=batch.rollout_logp[part],
                ref_logp=None if ref_logp is None else ref_logp.index_select(0, host_to(part, ref_logp.device)),
                tokens=tokens,
            )
        with _replay(run.learner, routes, seq_len, rows.tolist()):
            out = run.learner.train_step(batch.tokens[rows], _per_chunk(rows, n, chunk_loss), micro_batches=n)
        parts.append({k: float(v) for k, v in (out or {}).items() if _is_scalar(v)})
    for key in parts[0]:
        metrics[key] = sum(p[key] for p in parts) / len(parts)
    return metrics


def _per_chunk(rows: torch.Tensor, n: int, chunk_loss):
    """The loss_fn of Learner.train_step(micro_batches=n) over `rows` (gradient accumulation, rl.micro_batches):
    the learner calls it once per chunk of the rows, in order, and chunk_loss(logp, part) gives that chunk's loss and
    metrics as its shares of the whole; the metrics are scaled by n, as the learner averages them over the chunks."""
    chunks = iter(rows.chunk(n))

    def loss_fn(logp):
        part = next(chunks)
        if logp.shape[0] != len(part):
            raise ValueError(f"the learner gave loss_fn log-probs of {logp.shape[0]} rows for a chunk of {len(part)} "
                             "(rl.micro_batches needs a learner that calls loss_fn once per chunk, in order)")
        loss, metrics = chunk_loss(logp, part)  # device scalars (read once a step: Learner.train_step), in fp64 here
        return loss, {k: (v.double() if torch.is_tensor(v) else v) * n for k, v in metrics.items()}
    return loss_fn


def _replay(learner, routes, seq_len: int, rows: list[int]):
    """Routing replay for the learner's forward over `rows`: the learner splits them over data-parallel ranks
    (Learner.local_rows) and each rank forwards only its share, so it replays only that share's routes."""
    if routes is None:
        return learner_replay(learner, None, seq_len)
    return learner_replay(learner, routes, seq_len, [rows[i] for i in learner.local_rows(len(rows))])


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)


def sync_weights(run: Run) -> None:
    run.engine.update_weights(run.learner.named_weights())


def log_step(run: Run, metrics: dict) -> None:
    """Every rank keeps the history (and stops on a diverged run); rank 0 alone writes metrics.jsonl,
    TensorBoard and the progress bar (the metrics are global: the learner gathers the whole batch's log-probs)."""
    metrics = {"step": run.step, **metrics}
    run.history.append(metrics)
    scalars = {k: v for k, v in metrics.items() if k != "step"}
    check_finite(run.step, scalars)
    if run.logger is not None:
        run.logger.log(run.step, scalars)
    path = _metrics_path(run.cfg)
    if path is not None and is_writer():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


def log_warmup(run: Run, i: int, out: dict) -> None:
    """Warm-up step i (1-based) under its own tags (warmup/*, TensorBoard run dir/warmup) and in warmup.jsonl, so
    it never mixes with the RL steps' rows and a resume's purge of RL steps cannot touch it."""
    scalars = {(k if k.startswith("warmup/") else f"warmup/{k}"): float(v) for k, v in (out or {}).items()}
    check_finite(i, scalars)
    if run.logger is not None:
        run.logger.log_warmup(i, scalars)
    path = _metrics_path(run.cfg)
    if path is not None and is_writer():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(WARMUP_LOG), "a") as f:
            f.write(json.dumps({"warmup_step": i, **scalars}) + "\n")


def maybe_checkpoint(run: Run) -> None:
    c = run.cfg.checkpoint
    if not c.dir:
        return
    if not ((c.every and run.step % c.every == 0) or run.step == run.cfg.rl.steps):
        return
    with stop_cleanly(run.cfg, f"saving the checkpoint of step {run.step}", memory_fix=CHECKPOINT_TOO_BIG):
        state = {
            "learner": run.learner.state_dict(),
            "ref": None if run.ref is None else {n: t.detach().to("cpu", copy=True)
                                                 for n, t in run.ref.named_weights()},
            "rng": ckpt.capture_rng(),
            "data": run.stream.state_dict(),
            "config": config_for_checkpoint(run.cfg),  # the resume policy compares against it
        }
        path = ckpt.save_checkpoint(c.dir, run.step, state, keep=c.keep, layout=layout(run.cfg))
        if is_writer():
            log.info("saved checkpoint %s", path)


def layout(cfg) -> dict[str, int]:
    return {"tp": cfg.parallel.tp, "ep": cfg.parallel.ep, "pp": cfg.parallel.pp}


def is_writer() -> bool:
    """Rank 0 writes the run's shared files (metrics, TensorBoard, progress bar); every rank writes its shard."""
    return ckpt.rank_and_world()[0] == 0


# --------------------------------------------------------------------------------------------
# setup: build everything, then resume or warm up
# --------------------------------------------------------------------------------------------
def setup(cfg, *, learner_factory=None, engine_factory=None, reference_factory=None, fresh: bool = False) -> Run:
    """Build the run. `learner_factory(cfg)` / `engine_factory(cfg)` / `reference_factory(cfg)` may be injected
    (tests); defaults are the real ones. fresh: checkpoint.dir is being emptied (by rank 0), nothing there to mix."""
    task = make_task(cfg.rl.task, length=cfg.rl.task_length, num_digits=cfg.rl.task_digits)
    check_shapes(cfg, task)
    if not fresh:  # before building anything: a missing or incomplete checkpoint.resume_from fails fast, and so
        refuse_mixed_runs(cfg)  # does a start that would put two runs' checkpoints in checkpoint.dir
    # Model init and everything after it is a function of the config; NumPy and Python are seeded too, so the
    # RNG states a checkpoint saves do not depend on the process that happened to start the run.
    torch.manual_seed(cfg.rl.seed)
    random.seed(cfg.rl.seed)
    np.random.seed(cfg.rl.seed % 2**32)
    learner_factory = learner_factory or Learner
    learner = learner_factory(cfg)
    engine_factory = engine_factory or (lambda c: make_engine(c, pad_id=PAD))
    run = Run(cfg=cfg, learner=learner, engine=engine_factory(cfg), task=task,
              stream=PromptStream(task, batch_size=cfg.rl.prompts_per_step, seed=cfg.rl.seed),
              grpo=GRPOParams(clip_eps_low=cfg.rl.clip_eps, clip_eps_high=cfg.rl.clip_eps, kl_coef=cfg.rl.kl_coef,
                              is_correction=cfg.rl.is_correction, is_cap=cfg.rl.is_threshold))
    if cfg.rl.kl_coef > 0:
        run.ref = (reference_factory or reference_policy)(cfg)
    state = find_resume_state(cfg)  # after the learner (it starts torch.distributed): each rank loads its shard
    if state is not None:
        check_resume(state, cfg)  # the command line wins where it can; shape/precision/layout must match
    start = 0 if state is None else int(state["step"])
    if is_writer():
        start_logs(cfg, start)
        run.logger = MetricsLogger(cfg.logging.dir if cfg.logging.tensorboard else None, total_steps=cfg.rl.steps,
                                   start_step=start, progress=cfg.logging.progress_bar)
    if state is not None:
        resume(run, state)
    else:
        warmup(run)
        if run.ref is not None:
            run.ref.load_weights(learner.named_weights())
    sync_weights(run)
    if state is not None:
        ckpt.restore_rng(state["rng"])  # last: building models above consumed RNG
    return run


def _metrics_path(cfg) -> Path | None:
    return Path(cfg.logging.dir) / "metrics.jsonl" if cfg.logging.dir else None


def start_logs(cfg, step: int) -> None:
    """A run from step 0 starts a fresh metrics.jsonl, warm-up log and TensorBoard run: an earlier run's files there
    (`earlier_logs`) move to logging.dir/previous_run_N/ (N one above the highest there), named in a warning (--fresh
    deletes them first instead). So does a branch (checkpoint.resume_from) from a step the logs are past: their later
    rows are another run's. A run resumed at `step` from checkpoint.dir keeps the rows of steps <= step and drops the
    later ones (written after the checkpoint by the run that stopped), so the file never holds a step twice.
    TensorBoard: MetricsLogger's purge_step."""
    path = _metrics_path(cfg)
    if path is None:
        return
    rows = path.read_text().splitlines() if path.is_file() else []
    branch = bool(cfg.checkpoint.resume_from) and any(_row_step(line) > step for line in rows)
    if step == 0 or branch:
        old = earlier_logs(path.parent)
        if old:
            done = [int(m.group(1)) for p in path.parent.glob("previous_run_*")
                    if (m := re.fullmatch(r"previous_run_(\d+)", p.name))]
            keep = path.parent / f"previous_run_{max(done, default=0) + 1}"
            for p in old:
                to = keep / p.relative_to(path.parent)
                to.parent.mkdir(parents=True, exist_ok=True)
                p.replace(to)
            log.warning("logging.dir %s held an earlier run's logs (%s): moved to %s (--fresh deletes them instead)",
                        path.parent, ", ".join(sorted({p.name if p.parent == path.parent else
                                                       f"{WARMUP_RUN}/{p.name}" for p in old})), keep)
        return
    if path.exists():
        rows = [line for line in rows if _row_step(line) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(row + "\n" for row in rows))
        tmp.replace(path)


def earlier_logs(logdir: str | Path) -> list[Path]:
    """The files of logging.dir that a run writes and a run from step 0 must not append to: metrics.jsonl, the
    warm-up log and the TensorBoard event files of the run and of its warm-up run."""
    logdir = Path(logdir)
    found = [logdir / "metrics.jsonl", logdir / WARMUP_LOG, *logdir.glob("events.out.tfevents.*"),
             *(logdir / WARMUP_RUN).glob("events.out.tfevents.*")]
    return [p for p in found if p.is_file()]


def _row_step(line: str) -> float:
    """A metrics.jsonl row's step; a line cut short by a killed run counts as past any checkpoint (dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def check_shapes(cfg, task: DigitTask, world_size: int | None = None) -> None:
    """ValueError for a task the model cannot hold, or rows that the minibatches, micro-batches and data-parallel
    ranks cannot split (each of the learner's forwards takes a multiple of the data-parallel size). world_size: the
    processes of the run (default: the initialised process group's, else WORLD_SIZE, else 1)."""
    if cfg.model.vocab_size < task.tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} < the task vocabulary ({task.tokenizer.vocab_size})")
    need = task.prompt_len + cfg.rollout.max_new_tokens
    if need > cfg.model.max_position_embeddings:
        raise ValueError(f"prompt ({task.prompt_len}) + rollout.max_new_tokens exceeds model.max_position_embeddings")
    if cfg.rollout.max_new_tokens < task.response_len:
        log.warning("rollout.max_new_tokens=%d < %d: no response can earn full reward",
                    cfg.rollout.max_new_tokens, task.response_len)
    rows = cfg.rl.prompts_per_step * cfg.rollout.group_size
    if cfg.rl.minibatches > rows:
        raise ValueError(f"rl.minibatches={cfg.rl.minibatches} > rollouts per step ({rows})")
    n = cfg.rl.micro_batches
    sizes = sorted({len(c) for c in torch.arange(rows).chunk(cfg.rl.minibatches)})
    if any(s % n for s in sizes):  # (then n divides the warm-up's batch, their sum, too)
        raise ValueError(f"rl.micro_batches={n} does not divide the rows of a train step ({rows} rollouts, "
                         f"minibatches of {' / '.join(map(str, sizes))}): choose rl.micro_batches dividing them")
    if world_size is None:
        initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
        world_size = ckpt.rank_and_world()[1] if initialised else int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world_size // (cfg.parallel.tp * cfg.parallel.pp))
    forwards = {rows, *(s // n for s in sizes), *([rows // n] if cfg.rl.warmup_steps else [])}
    if any(f % dp for f in forwards):  # the log-prob passes take all rows; a train step's forward a chunk
        raise ValueError(f"the learner's forwards ({' / '.join(map(str, sorted(forwards)))} rows: rl.prompts_per_step "
                         f"x rollout.group_size, over rl.minibatches and rl.micro_batches) must be multiples of the "
                         f"{dp} data-parallel ranks")
    if n > 1 and cfg.alignment.routing_replay:
        raise ValueError("rl.micro_batches > 1 does not combine with alignment.routing_replay (its routes are "
                         "installed for a whole minibatch's forward): set one of them back")


def find_resume_state(cfg) -> dict | None:
    """This rank's shard of the checkpoint to resume from, or None. checkpoint.resume_from must be intact
    (CheckpointError otherwise); in checkpoint.dir the newest intact checkpoint wins, a corrupt newer one is named
    in a warning. A checkpoint of another world size or layout stops the run (it cannot be resumed here).
    Collective: every rank reaches the same decision (ckpt.agree_load)."""
    c, world = cfg.checkpoint, ckpt.rank_and_world()[1]
    if c.resume_from:
        ckpt.check_layout(c.resume_from, ckpt.read_manifest(c.resume_from), world, layout(cfg))
        return ckpt.agree_load(c.resume_from)
    if not (c.dir and c.resume):
        return None
    skipped: list = []  # (path, why) of the corrupt or incomplete ones newer than the one resumed from
    for path in ckpt.checkpoints_newest_first(c.dir):
        try:
            manifest = ckpt.read_manifest(path)
        except ckpt.CheckpointError as e:
            skipped.append((path, e))
            continue
        ckpt.check_layout(path, manifest, world, layout(cfg))
        try:
            state = ckpt.agree_load(path)
        except ckpt.CheckpointError as e:
            skipped.append((path, e))
            continue
        for bad, why in skipped:
            log.warning("skipping checkpoint %s: %s; resuming from the older %s", bad, why, path.name)
        return state
    if skipped:  # never restart from scratch (and overwrite the logs) over checkpoints the user may want back
        raise ckpt.CheckpointError(f"no intact checkpoint in {c.dir} ({len(skipped)} corrupt or incomplete; the "
                                   f"newest: {skipped[0][1]}): move them away, or start over with --fresh")
    return None


def resume(run: Run, state: dict) -> None:
    run.learner.load_state_dict(state["learner"])
    run.stream.load_state_dict(state["data"])
    run.step = int(state["step"])
    if run.ref is not None:
        if state.get("ref") is None:
            raise ckpt.CheckpointError("the checkpoint has no reference policy but rl.kl_coef > 0 needs one")
        run.ref.load_weights(state["ref"].items())
    log.info("resumed at step %d", run.step)


def warmup(run: Run) -> None:
    """Supervised warm-up: cross-entropy on correct answers (the response columns only)."""
    cfg = run.cfg
    stream = PromptStream(run.task, batch_size=cfg.rl.prompts_per_step * cfg.rollout.group_size,
                          seed=cfg.rl.seed + WARMUP_SEED_OFFSET)
    for i in range(cfg.rl.warmup_steps):
        raise_if_interrupted()
        problems = stream.next_batch()
        rows = [RolloutResult(prompt_index=k, prompt=p.prompt, tokens=p.target, logprobs=[0.0] * len(p.target))
                for k, p in enumerate(problems)]
        batch = make_batch(rows)
        def chunk_nll(logp, part, mask=batch.mask):
            # each chunk's token sum over the whole batch's tokens (an exact count: the same value as one chunk's
            # mask sum when it is the whole batch); built on the host, logp on the learner's device
            nll = -(logp * host_to(mask[part], logp.device)).sum() / host_to(mask.sum(), logp.device)
            return nll, {"warmup/nll": nll.detach()}

        n = cfg.rl.micro_batches  # gradient accumulation, as in train_on_batch
        with stop_cleanly(cfg, f"at warm-up step {i + 1} of {cfg.rl.warmup_steps}"):
            out = run.learner.train_step(batch.tokens, _per_chunk(torch.arange(len(rows)), n, chunk_nll),
                                         micro_batches=n)
            log_warmup(run, i + 1, out)
        if i == 0 or i + 1 == cfg.rl.warmup_steps:
            log.info("warm-up step %d/%d: %s", i + 1, cfg.rl.warmup_steps, out)
