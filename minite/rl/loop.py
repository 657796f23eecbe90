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
                     the engine's), then rl.minibatches optimizer steps on the GRPO loss
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minite.alignment.monitor import check_gap
from minite.alignment.routing_replay import engine_recording, learner_replay
from minite.rl import checkpoint as ckpt
from minite.rl.grpo import GRPOParams, group_advantages, grpo_loss
from minite.rl.metrics import MetricsLogger, mismatch_metrics, rollout_metrics
from minite.rl.resume_policy import check_resume, config_for_checkpoint
from minite.rl.tasks import PAD, DigitTask, Problem, PromptStream, make_task, mix_seed
from minite.rollout.base import RolloutEngine, RolloutResult, SamplingParams

log = logging.getLogger(__name__)
WARMUP_SEED_OFFSET = 1_000_003  # the warm-up stream must not replay the RL prompts


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
    ref: Any = None  # a frozen engine with .logprobs(tokens) when rl.kl_coef > 0
    step: int = 0
    history: list[dict] = field(default_factory=list)
    logger: MetricsLogger | None = None


def train(cfg) -> list[dict]:
    """Run cfg.rl.steps RL steps (resuming if a checkpoint exists); returns the per-step metrics."""
    run = setup(cfg)
    if run.step >= cfg.rl.steps:
        log.warning("checkpoint at step %d already reaches rl.steps=%d: nothing to do (raise rl.steps, "
                    "or start fresh with checkpoint.resume=false or another checkpoint.dir)", run.step, cfg.rl.steps)
    try:
        while run.step < cfg.rl.steps:
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
    cfg, t0 = run.cfg, time.perf_counter()
    problems = run.stream.next_batch()
    with engine_recording(run.engine, cfg.alignment.routing_replay) as rec:  # expert routes, to replay
        rollouts = run.engine.generate([p.prompt for p in problems], sampling_params(cfg, run.step, run.task))
    t_rollout = time.perf_counter() - t0
    rewards = score(run.task, problems, rollouts, cfg.rollout.group_size)
    advantages = group_advantages(rewards, cfg.rollout.group_size)
    batch = make_batch(rollouts)
    metrics = train_on_batch(run, batch, advantages, None if rec is None else rec.routes(len(rollouts)))
    sync_weights(run)
    run.step += 1
    elapsed = time.perf_counter() - t0
    metrics.update(rollout_metrics(rewards, batch.rollout_logp, batch.mask))
    metrics.update({"throughput/tokens_per_s": batch.num_tokens / elapsed,
                    "time/step_s": elapsed, "time/rollout_s": t_rollout})
    log_step(run, metrics)
    maybe_checkpoint(run)
    return metrics


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
    metrics = mismatch_metrics(learner_logp, batch.rollout_logp, batch.mask)
    check_gap(metrics, cfg.alignment, run.step)
    old_logp = learner_logp if cfg.rl.old_logp_source == "learner" else batch.rollout_logp
    ref_logp = run.ref.logprobs(batch.tokens).float() if run.ref is not None else None
    parts: list[dict] = []
    for rows in torch.arange(batch.tokens.shape[0]).chunk(cfg.rl.minibatches):
        def loss_fn(logp, rows=rows):
            return grpo_loss(
                logp, old_logp[rows], advantages[rows], batch.mask[rows], run.grpo,
                rollout_logp=batch.rollout_logp[rows],
                ref_logp=None if ref_logp is None else ref_logp[rows],
            )
        with _replay(run.learner, routes, seq_len, rows.tolist()):
            out = run.learner.train_step(batch.tokens[rows], loss_fn)
        parts.append({k: float(v) for k, v in (out or {}).items() if _is_scalar(v)})
    for key in parts[0]:
        metrics[key] = sum(p[key] for p in parts) / len(parts)
    return metrics


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
    metrics = {"step": run.step, **metrics}
    run.history.append(metrics)
    scalars = {k: v for k, v in metrics.items() if k != "step"}
    if run.logger is not None:
        run.logger.log(run.step, scalars)
    path = _metrics_path(run.cfg)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


def maybe_checkpoint(run: Run) -> None:
    c = run.cfg.checkpoint
    if not c.dir:
        return
    if (c.every and run.step % c.every == 0) or run.step == run.cfg.rl.steps:
        state = {
            "learner": run.learner.state_dict(),
            "ref": None if run.ref is None else {n: t.detach().clone() for n, t in run.ref.named_weights()},
            "rng": ckpt.capture_rng(),
            "data": run.stream.state_dict(),
            "config": config_for_checkpoint(run.cfg),  # the resume policy compares against it
        }
        path = ckpt.save_checkpoint(c.dir, run.step, state, keep=c.keep)
        log.info("saved checkpoint %s", path)


# --------------------------------------------------------------------------------------------
# setup: build everything, then resume or warm up
# --------------------------------------------------------------------------------------------
def setup(cfg, *, learner_factory=None, engine_factory=None) -> Run:
    """Build the run. `learner_factory(cfg)` / `engine_factory(cfg)` may be injected (tests); defaults are the real ones."""
    task = make_task(cfg.rl.task, length=cfg.rl.task_length, num_digits=cfg.rl.task_digits)
    check_shapes(cfg, task)
    state = find_resume_state(cfg)  # before building anything: a bad checkpoint fails fast
    if state is not None:
        check_resume(state, cfg)  # the command line wins where it can; shape/precision/layout must match
    torch.manual_seed(cfg.rl.seed)  # model init and everything after it is a function of the config
    if learner_factory is None:
        from minite.learner.learner import Learner as learner_factory
    learner = learner_factory(cfg)
    if engine_factory is None:
        from minite.rollout import make_engine

        engine_factory = lambda c: make_engine(c, pad_id=PAD)  # noqa: E731
    run = Run(cfg=cfg, learner=learner, engine=engine_factory(cfg), task=task,
              stream=PromptStream(task, batch_size=cfg.rl.prompts_per_step, seed=cfg.rl.seed),
              grpo=GRPOParams(clip_eps_low=cfg.rl.clip_eps, clip_eps_high=cfg.rl.clip_eps, kl_coef=cfg.rl.kl_coef,
                              is_correction=cfg.rl.is_correction, is_cap=cfg.rl.is_threshold))
    if cfg.rl.kl_coef > 0:
        run.ref = engine_factory(cfg)
    if state is not None:
        resume(run, state)
    else:
        _fresh_metrics_file(cfg)
        warmup(run)
        if run.ref is not None:
            run.ref.update_weights(learner.named_weights())
    sync_weights(run)
    if state is not None:
        ckpt.restore_rng(state["rng"])  # last: building models above consumed RNG
    run.logger = MetricsLogger(cfg.logging.dir if cfg.logging.tensorboard else None, total_steps=cfg.rl.steps,
                               start_step=run.step, progress=cfg.logging.progress_bar)
    return run


def _metrics_path(cfg) -> Path | None:
    return Path(cfg.logging.dir) / "metrics.jsonl" if cfg.logging.dir else None


def _fresh_metrics_file(cfg) -> None:
    """A fresh run starts a fresh metrics.jsonl; a resumed one appends to its own."""
    path = _metrics_path(cfg)
    if path is not None and path.exists():
        path.unlink()


def check_shapes(cfg, task: DigitTask) -> None:
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


def find_resume_state(cfg) -> dict | None:
    c = cfg.checkpoint
    if c.resume_from:
        return ckpt.load_checkpoint(c.resume_from)
    if c.dir and c.resume:
        path = ckpt.latest_checkpoint(c.dir)
        if path is not None:
            return ckpt.load_checkpoint(path)
    return None


def resume(run: Run, state: dict) -> None:
    run.learner.load_state_dict(state["learner"])
    run.stream.load_state_dict(state["data"])
    run.step = int(state["step"])
    if run.ref is not None:
        if state.get("ref") is None:
            raise ckpt.CheckpointError("the checkpoint has no reference policy but rl.kl_coef > 0 needs one")
        run.ref.update_weights(state["ref"].items())
    log.info("resumed at step %d", run.step)


def warmup(run: Run) -> None:
    """Supervised warm-up: cross-entropy on correct answers (the response columns only)."""
    cfg = run.cfg
    stream = PromptStream(run.task, batch_size=cfg.rl.prompts_per_step * cfg.rollout.group_size,
                          seed=cfg.rl.seed + WARMUP_SEED_OFFSET)
    for i in range(cfg.rl.warmup_steps):
        problems = stream.next_batch()
        rows = [RolloutResult(prompt_index=k, prompt=p.prompt, tokens=p.target, logprobs=[0.0] * len(p.target))
                for k, p in enumerate(problems)]
        batch = make_batch(rows)

        def loss_fn(logp, mask=batch.mask):
            nll = -(logp * mask).sum() / mask.sum()
            return nll, {"warmup/nll": nll.item()}

        out = run.learner.train_step(batch.tokens, loss_fn)
        if i == 0 or i + 1 == cfg.rl.warmup_steps:
            log.info("warm-up step %d/%d: %s", i + 1, cfg.rl.warmup_steps, out)
