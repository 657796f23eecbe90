"""The rollout's Gumbel-max sampler (`rollout.sampler: gumbel`): its definition, a pure-PyTorch reference, and the
dispatch to the Triton kernels (minite.kernels.gumbel_sample) on a GPU.

A token drawn as argmax_v(logit_v / T + G_v), with G_v = -log(-log(u_v)) standard Gumbel noise, is a draw from
softmax(logits / T): the same distribution as Megatron-Core's ops (softmax, then argmax(p / q) with q ~ Exp(1),
minite.rollout.decode `sample`), since -log(q) is Gumbel and argmax is unchanged by the softmax's normalisation, up to
how far into the tail each one's noise reaches (below). What differs is where the uniforms come from and how many
passes it takes: Megatron's draw is torch's exponential_ over a [batch, vocab] buffer; here u_v is a pure function of
(seed, row, v), Philox4x32-10 (counter-based, as torch's CUDA generator and Triton's tl.rand) under a key drawn from
the rollout's generator once per step, so one pass over the logits computes everything, and a row's draw does not
depend on the other rows of its batch (a compacted batch names each row's id in the whole batch).

    per step: seed = randint(2^62) from the generator (one int64, on the logits' device)
    logit v = c * CHUNK + j * QUARTER + i (chunk c, quarter j, lane i):
        (w0, w1, w2, w3) = Philox4x32-10(counter (c * QUARTER + i, row id, 0, 0), key (seed mod 2^32, seed >> 32))
        u = (w_j + 0.5) * 2^-32, d = (~w_j + 0.5) * 2^-32     fp32 (each word rounded to fp32 first); d ~ 1 - u
        e = -log(u), Exp(1); where d < 2^-6 as d + d^2/2 + d^3/3 + d^4/4 (within 1.4 ulp)
        score = logit / T - log(e)        a NaN score counts as -inf, as does every v >= min(V, vocab_size)
    token = the lowest v of the largest score (0 if every score is -inf)

The Philox words are exact integer arithmetic, bitwise the same here and in the kernels (tests/rollout/
test_sampling.py, also against Random123's known answers); the scores use the device's log and division, so the two
can pick different tokens only where two scores lie within a rounding of each other. The series near u = 1: there
-log(u) is tiny and decides the largest scores, and a GPU's approximate log (an absolute error near 2^-22) would lose
its relative precision, even give 0 (a score of +inf). From all 32 bits of the word, the smallest e is about 2^-33,
so the noise reaches 22.9 nats above its mode: a token up to ~22 nats below the best one can be drawn. (Megatron's
ops reach about 16.6: torch's CUDA exponential_ floors q at 2^-24. So did this sampler's first form, from 23 bits.)
Non-finite logits give some token in the vocabulary; the caller's log-probs (NaN) are what catches them.
"""
from __future__ import annotations

import torch

QUARTER = 1024
"""Lanes of one Philox call's four words (minite.kernels.gumbel_sample.QUARTER: the same layout)."""
CHUNK = 4 * QUARTER
SEED_BOUND = 2 ** 62
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # and its key increments (Random123)
_U32 = 0xFFFFFFFF


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m * c) >> 32 and (m * c) mod 2^32 for uint32 values held in int64, without an int64 overflow: c in 16-bit
    halves, each product under 2^48."""
    hi_part, lo_part = m * (c >> 16), m * (c & 0xFFFF)
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _U32
    return hi, lo


def philox4x32(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of counter words c0..c3 (int64 tensors or ints holding uint32 values) under the key (k0, k1):
    four int64 tensors of uint32 values."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3))
    for _ in range(10):
        h0, l0 = _mulhilo(_M0, c0)
        h1, l1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
        k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
    return c0, c1, c2, c3


def exponential(words: torch.Tensor) -> torch.Tensor:
    """fp32: e of the module docstring for Philox words (int64 holding uint32 values)."""
    u = (words.to(torch.float32) + 0.5) * 2.0 ** -32
    d = ((words ^ _U32).to(torch.float32) + 0.5) * 2.0 ** -32
    return torch.where(d < 2.0 ** -6, d + d * d * (0.5 + d * (1 / 3 + d * 0.25)), -torch.log(u))


def exponentials(seed: int | torch.Tensor, row_ids: torch.Tensor, width: int, quarter: int = QUARTER
                 ) -> torch.Tensor:
    """fp32 [len(row_ids), width] on the CPU: e of logits 0..width-1 of each row id (a seed tensor is used as a
    tensor: no host read on the CPU); `quarter`: the layout's QUARTER."""
    return exponential(_words(seed, row_ids, width, quarter))


def _words(seed: int | torch.Tensor, row_ids: torch.Tensor, width: int, quarter: int) -> torch.Tensor:
    """int64 [len(row_ids), width]: each logit's Philox word (module docstring). One Philox call per logit, its word j
    taken: the kernels make one call for the four logits of a lane, here each of them makes it again."""
    seed = torch.as_tensor(seed, dtype=torch.int64).cpu().view(())
    chunk = 4 * quarter
    v = torch.arange(width, dtype=torch.int64)
    words = torch.stack(philox4x32((v // chunk) * quarter + v % quarter, row_ids.to(torch.int64).cpu().view(-1, 1),
                                   0, 0, seed & _U32, (seed >> 32) & _U32))
    j = ((v % chunk) // quarter).expand(words.shape[1], width)
    return words.gather(0, j.unsqueeze(0)).squeeze(0)


def check(logits: torch.Tensor, vocab_size: int, rows: torch.Tensor | None) -> int:
    """Refuse in one line what the sampler cannot take; the vocabulary it samples from, min(V, vocab_size)."""
    if logits.dim() != 2:
        raise ValueError(f"gumbel_sample: logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    limit = min(logits.shape[1], vocab_size)
    if limit < 1:
        raise ValueError(f"gumbel_sample: nothing to sample from (logits of width {logits.shape[1]}, vocab_size "
                         f"{vocab_size})")
    if rows is not None and (rows.shape != (logits.shape[0],) or rows.dtype not in (torch.int32, torch.int64)
                             or rows.device != logits.device):
        raise ValueError(f"gumbel_sample: rows must be one int32/int64 id per logits row on {logits.device}, got "
                         f"{rows.dtype} {tuple(rows.shape)} on {rows.device} for {logits.shape[0]} rows")
    return limit


def gumbel_sample_reference(logits: torch.Tensor, seed: int | torch.Tensor, temperature: float, vocab_size: int,
                            rows: torch.Tensor | None = None, quarter: int = QUARTER) -> torch.Tensor:
    """int64 [n] on logits' device: the module docstring's tokens for logits [n, V], in PyTorch ops (`quarter`: the
    layout's QUARTER, as the kernels take it)."""
    limit = check(logits, vocab_size, rows)
    n = logits.shape[0]
    row_ids = torch.arange(n) if rows is None else rows
    x = logits[:, :limit].to(torch.float32)
    if temperature != 1.0:
        x = x / temperature
    score = x - torch.log(exponentials(seed, row_ids, limit, quarter).to(logits.device))
    return torch.where(torch.isnan(score), float("-inf"), score).argmax(dim=-1)


def gumbel_sample(logits: torch.Tensor, temperature: float, generator: torch.Generator, vocab_size: int,
                  rows: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [n, V] (float; on a GPU with unit stride over V): one seed from the generator,
    then on CUDA the Triton kernels (two launches, no host synchronisation; `lse`, fp32 [n], filled with each row's
    log-sum-exp over V in the same pass: CUDA only), elsewhere the reference; each refuses what it cannot take in one
    line."""
    if lse is not None and not logits.is_cuda:
        raise ValueError("gumbel_sample: lse= is the Triton kernels' (CUDA); on the CPU take torch's log_softmax")
    seed = torch.randint(SEED_BOUND, (1,), dtype=torch.int64, device=logits.device, generator=generator)
    if logits.is_cuda:
        from minite.kernels.gumbel_sample import gumbel_sample_triton
        return gumbel_sample_triton(logits, seed, temperature, vocab_size, rows, lse=lse)
    return gumbel_sample_reference(logits, seed, temperature, vocab_size, rows)
