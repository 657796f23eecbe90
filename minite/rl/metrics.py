"""What the RL loop measures each step, and where it goes (TensorBoard + a tqdm progress bar).

Fixed TensorBoard tags (acceptance checks read them; do not rename):
    reward/mean               mean task reward of the step's rollouts
    loss/policy               GRPO policy loss (token mean), last minibatch of the step
    kl/ref                    K3 estimate of KL(pi || ref) on the sampled tokens (0 without a reference)
    mismatch/logp_abs_mean    mean over response tokens of |logp_train - logp_rollout|
    mismatch/logp_abs_max     max of the same
    mismatch/k3_kl            K3 estimate of KL(rollout || train): mean of exp(d) - d - 1, d = logp_train - logp_rollout
    throughput/tokens_per_s   tokens of the step's sequences (prompt + response, all samples) / step wall time

The mismatch numbers compare the learner's log-probs of the sampled tokens, computed after the
rollout with the same weights the engine sampled with, against the engine's own. They are the
project's measure of a precision path (docs/upstream.md: about 5e-3 mean |dlogp| is
reported for an unaligned large MoE; 0 is the goal of strict alignment). The tokens were drawn by
the rollout policy, so the K3 estimate is of KL(rollout || train).

Entropy: the learner returns only the sampled tokens' log-probs, so `train/entropy` is the Monte
Carlo estimate -mean(logp_rollout(sampled token)), unbiased for the per-token entropy of the
sampling distribution when sampling at temperature 1 without top-p.
"""
from __future__ import annotations

import math

import torch

from minite.nvfp4 import NonFiniteError
from minite.rl.grpo import k3

TAGS = (
    "reward/mean",
    "loss/policy",
    "kl/ref",
    "mismatch/logp_abs_mean",
    "mismatch/logp_abs_max",
    "mismatch/k3_kl",
    "throughput/tokens_per_s",
)


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train/rollout log-prob gap over masked (response) tokens; tensors [B, T-1], on train_logp's device.

    Beside the mean, max and k3 KL: where the largest gap is (`max_at_train_logp` / `max_at_rollout_logp`: the two
    log-probs of that token, so a gap of one side's unlikely token is told from the other's; `max_at_position`: its
    position in the response, 0 = the first generated token) and `tokens_over_1`: how many tokens differ by over
    1 nat (one outlier or many)."""
    rollout_logp, m = rollout_logp.to(train_logp.device), mask.to(train_logp.device).bool()
    if not m.any():
        return {"mismatch/logp_abs_mean": 0.0, "mismatch/logp_abs_max": 0.0, "mismatch/k3_kl": 0.0,
                "mismatch/max_at_train_logp": 0.0, "mismatch/max_at_rollout_logp": 0.0,
                "mismatch/max_at_position": 0.0, "mismatch/tokens_over_1": 0.0}
    diff = train_logp.double() - rollout_logp.double()
    d = diff[m]
    gap = d.abs()
    # where the largest gap is, found over the whole [B, T-1] grid (masked-out positions at -1): fixed sizes, no host
    # read until .item() (the device-placement test runs this on fake tensors)
    at = torch.where(m, diff.abs(), -1.0).flatten().argmax().view(1)
    position = (m.cumsum(dim=1) - 1).flatten().index_select(0, at)  # its index among its row's response tokens
    return {
        "mismatch/logp_abs_mean": gap.mean().item(),
        "mismatch/logp_abs_max": gap.max().item(),
        "mismatch/k3_kl": k3(d).mean().item(),
        "mismatch/max_at_train_logp": train_logp.flatten().index_select(0, at).double().item(),
        "mismatch/max_at_rollout_logp": rollout_logp.flatten().index_select(0, at).double().item(),
        "mismatch/max_at_position": position.double().item(),
        "mismatch/tokens_over_1": (gap > 1).sum().double().item(),
    }


def rollout_metrics(rewards: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Reward, response length and the sampled-token entropy estimate."""
    lengths = mask.sum(dim=1).double()
    n = mask.sum().clamp(min=1)
    return {
        "reward/mean": rewards.double().mean().item(),
        "reward/max": rewards.double().max().item(),
        "rollout/response_len": lengths.mean().item(),
        "train/entropy": (-(rollout_logp.double() * mask).sum() / n).item(),
    }


def check_finite(step: int, scalars: dict[str, float]) -> None:
    bad = [k for k, v in scalars.items() if not math.isfinite(v)]
    if bad:
        raise NonFiniteError(f"non-finite metrics {bad} at step {step}")


WARMUP_RUN = "warmup"  # the TensorBoard run (a subdirectory of the log dir) of the warm-up scalars


class MetricsLogger:
    """Writes scalars to TensorBoard (if a log dir is given) and drives a tqdm bar over RL steps (one process only:
    the loop makes it on rank 0). The event files and the bar appear with the first scalar, so an invocation that
    has nothing to do leaves no empty event file. A run resumed at `start_step` opens its writer with
    purge_step=start_step + 1: TensorBoard drops the stopped run's events of the steps that are logged again.
    Warm-up scalars go to their own TensorBoard run (logdir/warmup) with the warm-up step as x."""

    def __init__(self, logdir: str | None, *, total_steps: int, start_step: int = 0, progress: bool = True):
        self.logdir, self.total_steps, self.start_step, self.progress = logdir, total_steps, start_step, progress
        self.writer = self.warmup_writer = self.bar = None

    def _writer(self, sub: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        if sub is not None:
            return SummaryWriter(log_dir=f"{self.logdir}/{sub}")
        return SummaryWriter(log_dir=self.logdir, purge_step=self.start_step + 1 if self.start_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        check_finite(step, scalars)
        if self.logdir and self.writer is None:
            self.writer = self._writer()
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.progress and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=self.start_step, desc="rl", unit="step",
                            dynamic_ncols=True)
        if self.bar is not None:
            self.bar.set_postfix(
                reward=f"{scalars.get('reward/mean', 0):.3f}",
                dlogp=f"{scalars.get('mismatch/logp_abs_mean', 0):.1e}",
                tok_s=f"{scalars.get('throughput/tokens_per_s', 0):.0f}",
            )
            self.bar.update(1)

    def log_warmup(self, step: int, scalars: dict[str, float]) -> None:
        if not self.logdir:
            return
        if self.warmup_writer is None:
            self.warmup_writer = self._writer(WARMUP_RUN)
        for tag, value in scalars.items():
            self.warmup_writer.add_scalar(tag, value, step)
        self.warmup_writer.flush()

    def close(self) -> None:
        for w in (self.writer, self.warmup_writer):
            if w is not None:
                w.close()
        if self.bar is not None:
            self.bar.close()
