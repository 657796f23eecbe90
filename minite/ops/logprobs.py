"""Default-mode token log-probs as logit - log-sum-exp, the log-sum-exp from the Gumbel sampler's pass
(minite.kernels.gumbel_sample, `lse`), written once for the rollout and the learner.

A default-mode rollout on a GPU gets each row's log-sum-exp from the pass that samples its token, so a token's
log-prob needs no log-softmax over [batch, vocab]: logit[token] - lse (~65 us of a 1.6 ms batch-64 NVFP4 decode step
on an H100, session 36's profile). Those are not torch's log_softmax bits (tests/tolerances.py "lse_fused"), so the
learner's log-probs without a gradient (`minite diagnose`, the RL loss's reference) take the same kernel
(`row_logsumexp`: the sampler's chunk and pick launches with the draws compiled out: a learner's [tokens, V] logits
pay no Philox words nor logs), and where the two forwards give the same logits the two sides give the same log-probs,
as torch's log-softmax gave them before. The learner's training forward (under autograd) keeps torch's log-softmax,
so with rl.old_logp_source "learner" the GRPO ratio of identical forwards is 1 to within "lse_fused" rather than
exactly 1 (on a GPU the no-grad and training forwards already differ in default mode: the combine's and the router's
kernels run without autograd only). Strict mode has its own
(minite.strict.ops.token_log_softmax).

Same bits on both sides needs the same log-sum-exp code in the same layout: Triton specialises a launch on its integer
arguments' and pointers' divisibility by 16 and on the logits' dtype, which decide how a quarter's logits are loaded
and so the order of tl.sum. Both sides pass rows of stride V (`lse_applies` asks for it, and for a 16-byte aligned
start); the rollout's bf16 logits (CUDA-graph steps, minite.rollout.decode.LOGITS_IN_PLACE) load in the layout of the
learner's fp32 ones at the kernel's QUARTER and NUM_WARPS (4 a thread, minite.kernels.gumbel_sample.NUM_WARPS); the
rollout's other arguments (temperature, compacted row ids) and the learner's dropped draws do not touch the
log-sum-exp's ops. tests/rollout/test_sampling.py checks it bit for bit on the GPU.

Routed where `LSE_KERNEL` is in minite.strict.fused.PROVEN (since its GPU test passed, 2026-12-06), on CUDA only.
"""
from __future__ import annotations

import torch

from minite.strict import fused

LSE_KERNEL = "sampler_lse"


def lse_applies(logits: torch.Tensor) -> bool:
    """Whether log-probs of these logits [rows, V] take the sampler's log-sum-exp: CUDA, the kernel proven, rows of
    stride V from a 16-byte aligned start (the specialisations whose sums agree: module docstring)."""
    return (logits.is_cuda and LSE_KERNEL in fused.PROVEN and logits.dim() == 2 and logits.stride(1) == 1
            and logits.stride(0) == logits.shape[1] and logits.data_ptr() % 16 == 0)


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: each row's log-sum-exp over all V logits of [rows, V] (unit stride over V), the bits the sampler's
    pass gives a rollout on the same row (module docstring; CUDA)."""
    from minite.kernels.gumbel_sample import row_logsumexp_triton

    return row_logsumexp_triton(logits)


def logprobs_at(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: log_softmax(logits [rows, V])[row, tokens[row]] as logits[row, tokens[row]] - lse[row]."""
    return torch.gather(logits, 1, tokens.reshape(-1, 1)).view(-1).to(torch.float32) - lse
