"""GRPO: group-normalised advantages and the PPO-clipped policy loss, with rollout corrections.

Notation, per response token t of sequence i (all log-probs are of the sampled token):
    logp        learner log-prob under the weights being trained (carries the gradient)
    old_logp    the behaviour policy's log-prob: the learner's own, computed before the update
                ("learner", the default), or the rollout engine's ("rollout")
    rollout_logp  what the rollout engine reported when it sampled the token
    ref_logp    a frozen reference policy (for the optional KL penalty)

Advantages (GRPO, Shao et al. 2024): the n responses to one prompt form a group;
    A_i = (r_i - mean_group(r)) / (std_group(r) + eps)        (population std; eps keeps A finite)
and every token of response i gets A_i. A group whose rewards are all equal gets A = 0.

Policy loss (PPO clip, Schulman et al. 2017) with ratio rho = exp(logp - old_logp):
    L_pg(t) = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)

Train/rollout mismatch correction. The tokens were sampled by the rollout engine, whose numerics
differ from the learner's (different kernels, batch shapes, precision paths), so
w = exp(old_logp - rollout_logp) != 1 even at identical weights. Two standard fixes, both
detached weights on the per-token loss, chosen by `is_correction`:
    "tis"  truncated importance sampling (Yao et al. 2025): multiply by min(w, is_cap)
    "mis"  masked importance sampling: drop tokens whose w lies outside [1/is_cap, is_cap],
           keep the rest with weight 1 (the IcePop-style mask)
    "none" no correction
They only make sense with old_logp from the learner; with old_logp = rollout_logp, w == 1.

KL to the reference (optional, kl_coef > 0) uses the K3 estimator (Schulman 2020), unbiased for
KL(pi || ref) on samples from pi and always >= 0:
    k3(t) = exp(ref_logp - logp) - (ref_logp - logp) - 1

Aggregation: the mean over all response tokens of the batch (token-level, as in DAPO), so a long
response weighs more than a short one and a batch's loss does not depend on how it is split into
sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.nvfp4.device_copy import host_to

IS_CORRECTIONS = ("none", "tis", "mis")


@dataclass(frozen=True, kw_only=True)
class GRPOParams:
    """Knobs of the loss; validated once here so the hot path does not re-check."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    is_correction: str = "none"
    is_cap: float = 2.0

    def __post_init__(self):
        if not (0 < self.clip_eps_low < 1 and self.clip_eps_high > 0):
            raise ValueError(
                f"clip eps must satisfy 0 < low < 1 and high > 0, got {self.clip_eps_low}, {self.clip_eps_high}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {self.is_correction!r}")
        if self.is_cap <= 1:
            raise ValueError(f"is_cap must be > 1, got {self.is_cap}")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * n] (groups contiguous) -> advantages [G * n], normalised within each group."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    r = rewards.double().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1).to(rewards.dtype)


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """K3 estimator exp(x) - x - 1 for x = log(q/p) on samples from p: >= 0, mean -> KL(p || q)."""
    return torch.expm1(log_ratio) - log_ratio


def is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, params: GRPOParams) -> torch.Tensor:
    """Detached per-token importance weights correcting rollout-vs-learner numerics."""
    if params.is_correction == "none":
        return torch.ones_like(old_logp)
    w = torch.exp(old_logp - rollout_logp).detach()
    if params.is_correction == "tis":
        return w.clamp(max=params.is_cap)
    keep = (w <= params.is_cap) & (w >= 1.0 / params.is_cap)
    return keep.to(old_logp.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
    """Sum of x over mask / the mask's count, or / `tokens` when given (a chunk's share of a larger batch's mean)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if tokens is None else max(tokens, 1.0))


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    *,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean GRPO loss over `mask` (1 on response tokens). Tensors are [B, T-1]; advantages [B].

    Returns (loss with grad, metrics): loss/policy, kl/ref, clip_frac, is_weight_mean, is_masked_frac, each a
    detached scalar tensor on logp's device (read on the host once per optimizer step, by Learner.train_step: a
    read per micro-batch would make the host wait for the GPU each time). The host tensors it is given are copied
    to that device without a synchronisation (`host_to`).
    tokens: the token count of the batch these rows are a chunk of (gradient accumulation): every mean is then this
    chunk's sum over it, its share, so the chunks' losses and metrics add up to the whole batch's.
    """
    dev = logp.device  # the learner's device; the loop builds its batch tensors on the host (copied without a sync)
    old_logp, mask = host_to(old_logp, dev), host_to(mask, dev).to(logp.dtype)
    adv = host_to(advantages, dev).to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp.detach())
    clipped = ratio.clamp(1 - params.clip_eps_low, 1 + params.clip_eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    if rollout_logp is not None:
        w = is_weights(old_logp.detach(), host_to(rollout_logp, dev), params)
    else:
        w = torch.ones_like(pg)
    policy = _masked_mean(w * pg, mask, tokens)
    loss = policy
    kl = torch.zeros((), dtype=logp.dtype, device=dev)
    if ref_logp is not None:
        kl = _masked_mean(k3(host_to(ref_logp.detach(), dev) - logp), mask, tokens)
        if params.kl_coef > 0:
            loss = loss + params.kl_coef * kl
    with torch.no_grad():
        clip_active = (ratio * adv > clipped * adv).to(logp.dtype)
        metrics = {
            "loss/policy": policy.detach(),
            "kl/ref": kl.detach(),
            "train/clip_frac": _masked_mean(clip_active, mask, tokens),
            "train/is_weight_mean": _masked_mean(w, mask, tokens),
            "train/is_masked_frac": _masked_mean((w == 0).to(logp.dtype), mask, tokens),
        }
    return loss, metrics
