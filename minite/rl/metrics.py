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
    """Train/rollout log-prob gap over masked (response) tokens; tensors [B, T-1]."""
    m = mask.bool()
    if not m.any():
        return {"mismatch/logp_abs_mean": 0.0, "mismatch/logp_abs_max": 0.0, "mismatch/k3_kl": 0.0}
    d = (train_logp.double() - rollout_logp.double())[m]
    return {
        "mismatch/logp_abs_mean": d.abs().mean().item(),
        "mismatch/logp_abs_max": d.abs().max().item(),
        "mismatch/k3_kl": k3(d).mean().item(),
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


class MetricsLogger:
    """Writes scalars to TensorBoard (if a log dir is given) and drives a tqdm bar over RL steps."""

    def __init__(self, logdir: str | None, *, total_steps: int, start_step: int = 0, progress: bool = True):
        self.writer = None
        if logdir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=logdir)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        bad = [k for k, v in scalars.items() if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"step {step}: non-finite metrics {bad}: the run has diverged")
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.bar is not None:
            self.bar.set_postfix(
                reward=f"{scalars.get('reward/mean', 0):.3f}",
                dlogp=f"{scalars.get('mismatch/logp_abs_mean', 0):.1e}",
                tok_s=f"{scalars.get('throughput/tokens_per_s', 0):.0f}",
            )
            self.bar.update(1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
