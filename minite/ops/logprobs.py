"""Default-mode token log-probs as logit - log-sum-exp, the log-sum-exp from the Gumbel sampler's pass
(minite.kernels.gumbel_sample, `lse`), written once for the rollout and the learner.

A default-mode rollout on a GPU gets each row's log-sum-exp from the pass that samples its token, so a token's
log-prob needs no log-softmax over [batch, vocab]: logit[token] - lse (~65 us of a 1.6 ms batch-64 NVFP4 decode step
on an H100, session 36's profile). Those are not torch's log_softmax bits (tests/tolerances.py "lse_fused"), so the
learner's log-probs without a gradient (`minite diagnose`, the RL loss's reference) take the same kernel
(`row_logsumexp`: the sampler's launch at temperature 1, its tokens unused), and where the two forwards give the same
logits the two sides give the same log-probs, as torch's log-softmax gave them before. The learner's training forward
(under autograd) keeps torch's log-softmax. Strict mode has its own (minite.strict.ops.token_log_softmax).

Routed where `LSE_KERNEL` is in minite.strict.fused.PROVEN (its GPU test: fused.WAITS_FOR), on CUDA only.
"""
from __future__ import annotations

import torch

from minite.strict import fused

LSE_KERNEL = "sampler_lse"


def lse_applies(logits: torch.Tensor) -> bool:
    """Whether log-probs of these logits [rows, V] take the sampler's log-sum-exp: CUDA, and the kernel proven."""
    return logits.is_cuda and LSE_KERNEL in fused.PROVEN


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: each row's log-sum-exp over all V logits of [rows, V] (unit stride over V), the bits the sampler's
    pass gives a rollout at temperature 1 on the same row (the same launch; CUDA)."""
    from minite.kernels.gumbel_sample import gumbel_sample_triton

    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    gumbel_sample_triton(logits, torch.zeros(1, dtype=torch.int64, device=logits.device), 1.0, logits.shape[1],
                         lse=lse)
    return lse


def logprobs_at(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: log_softmax(logits [rows, V])[row, tokens[row]] as logits[row, tokens[row]] - lse[row]."""
    return torch.gather(logits, 1, tokens.reshape(-1, 1)).view(-1).to(torch.float32) - lse
