"""The rollout's token sampler in two launches: Gumbel-max over logits / temperature with a counter-based Philox
stream (minite.rollout.sampling holds the definition and its pure-PyTorch reference).

Megatron-Core's sampling ops make about ten passes over [batch, vocab] fp32 (softmax, an exponential draw, a division,
an argmax): at batch 256 over the 151,936-word vocabulary ~0.5 ms of a 3.6 ms decode step on an H100
(docs/benchmarks.md, thirty-fourth session). Here each program reads one chunk of a row's logits once, draws their
uniforms, and keeps the chunk's largest score and its index; a second launch picks each row's best chunk.

    chunk c of row r (CHUNK logits, four quarters of QUARTER): Philox4x32-10 of the counter
        (c * QUARTER + i, row id, 0, 0) under the key (seed mod 2^32, seed >> 32) gives four words, word j for
        logit c * CHUNK + j * QUARTER + i
    u = (word + 0.5) * 2^-32, d = (~word + 0.5) * 2^-32 in fp32 (d ~ 1 - u)
    e = -log(u), as d + d^2/2 + d^3/3 + d^4/4 where d < 2^-6 (the GPU's log near 1 is not accurate enough there)
    score = logit / temperature - log(e)          (a NaN score counts as -inf; from min(V, vocab_size) on: -inf)
    token = the lowest index of the largest score

The Philox words are bitwise the reference's (integer arithmetic); the scores go through the device's log and
division (on a GPU Triton's approximate instructions, with FMA contraction), so a token can differ from the
reference's only where two scores lie within those roundings of each other.

With `lse` the same pass also gives each row's log-sum-exp over all its V logits (untempered: the log-probs' norm),
so a default-mode rollout takes its token log-probs as logit - lse without a log-softmax over [batch, V]:

    per quarter: m = max x, s = sum exp(x - m); merged (chunk, then row): m = max(m1, m2),
        s = s1 exp(m1 - m) + s2 exp(m2 - m), where an m of -inf counts as 0 inside the exps
    lse = m + log(s)                    NaN where a logit is NaN or +inf; -inf where every logit is -inf (then the
                                        log-probs logit - lse are NaN, as log_softmax's)

Its fp32 sums run in another order than torch's log_softmax, through the device's exp and log: within
tests/tolerances.py "lse_fused" of it, not bitwise. `row_logsumexp_triton` is the log-sum-exp alone (the learner's),
the same two launches with the draws compiled out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher, next_power_of_2

QUARTER = 1024
CHUNK = 4 * QUARTER
NUM_WARPS = 8
"""The launch's warps. With QUARTER they fix how many logits a thread loads: QUARTER / (32 NUM_WARPS) = 4, which is
what Triton gives fp32 and bf16 logits alike on sm_90 (16-byte and 8-byte loads); so a rollout's bf16 logits
(minite.rollout.decode.LOGITS_IN_PLACE) and a learner's fp32 ones sum their log-sum-exp in the same order. At 8 a
thread (QUARTER 2048 here) bf16 would load 8 and fp32 4, and the bits would differ."""
assert QUARTER // (32 * NUM_WARPS) <= 4


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al., SC'11; Random123's constants) of four uint32 counter words under a two-word key."""
    for _ in tl.static_range(10):
        h0 = tl.umulhi(c0, 0xD2511F53)
        h1 = tl.umulhi(c2, 0xCD9E8D57)
        l0 = c0 * 0xD2511F53
        l1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def exponential(word):
    """e = -log(u) of uint32 Philox words (module docstring): Exp(1) draws."""
    u = (word.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    d = ((word ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # ~ 1 - u
    return tl.where(d < 0.015625, d + d * d * (0.5 + d * (0.3333333432674408 + d * 0.25)), -tl.log(u))


@triton.jit
def _shift(m):
    """The max an exp(x - max) subtracts: m, or 0 where m is -inf (module docstring)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _merge(m1, s1, m2, s2):
    """(m, s) of two parts' (max, sum of exp(x - max)) (module docstring): m = max(m1, m2), each s rescaled to it."""
    m = tl.maximum(m1, m2)
    ms = _shift(m)
    return m, s1 * tl.exp(m1 - ms) + s2 * tl.exp(m2 - ms)


@triton.jit
def _quarter_best(x_ptr, start, i, word, vocab, width, temperature, best, at, m, es, SCALE: tl.constexpr,
                  LSE: tl.constexpr, DRAW: tl.constexpr):
    """(best, at, m, es) updated with one quarter's logits (start + i): (best, at) take its largest score and that
    score's index (the lowest of equal ones) where the score is larger than best, so the earlier index wins a tie;
    with LSE (m, es) merge its max and sum of exponentials over the logits below width (all V of the row). Without
    DRAW (the log-sum-exp alone) no score: (best, at) are returned as given."""
    v = start + i
    x = tl.load(x_ptr + v, mask=v < width, other=float("-inf")).to(tl.float32)
    if LSE:
        qm = tl.max(x, 0)
        qs = tl.sum(tl.exp(x - _shift(qm)), 0)
        m, es = _merge(m, es, qm, qs)
    if DRAW:
        if SCALE:
            x = x / temperature
        s = x - tl.log(exponential(word))
        s = tl.where((s == s) & (v < vocab), s, float("-inf"))
        top = tl.max(s, 0)
        take = top > best
        best, at = tl.where(take, top, best), tl.where(take, start + tl.argmax(s, 0, tie_break_left=True), at)
    return best, at, m, es


@triton.jit
def _chunk_best_kernel(x_ptr, stride_row, rows_ptr, seed_ptr, best_ptr, index_ptr, max_ptr, sum_ptr, vocab, width,
                       n_chunks, temperature, HAS_ROWS: tl.constexpr, SCALE: tl.constexpr, QUARTER: tl.constexpr,
                       LSE: tl.constexpr, DRAW: tl.constexpr = True):
    r = tl.program_id(0)
    c = tl.program_id(1)
    i = tl.arange(0, QUARTER)
    z = tl.zeros([QUARTER], dtype=tl.uint32)
    if DRAW:
        if HAS_ROWS:
            row = tl.load(rows_ptr + r).to(tl.uint32)
        else:
            row = r.to(tl.uint32)
        seed = tl.load(seed_ptr)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        w0, w1, w2, w3 = philox4x32((c * QUARTER + i).to(tl.uint32), z + row, z, z, k0, k1)
    else:  # the log-sum-exp alone (`row_logsumexp_triton`): no words drawn
        w0, w1, w2, w3 = z, z, z, z
    x_row = x_ptr + r.to(tl.int64) * stride_row
    start = c * (4 * QUARTER)
    m, es = float("-inf"), 0.0  # the chunk's max and sum of exponentials so far (LSE)
    best, at, m, es = _quarter_best(x_row, start, i, w0, vocab, width, temperature, float("-inf"), start, m, es,
                                    SCALE, LSE, DRAW)
    best, at, m, es = _quarter_best(x_row, start + QUARTER, i, w1, vocab, width, temperature, best, at, m, es,
                                    SCALE, LSE, DRAW)
    best, at, m, es = _quarter_best(x_row, start + 2 * QUARTER, i, w2, vocab, width, temperature, best, at, m, es,
                                    SCALE, LSE, DRAW)
    best, at, m, es = _quarter_best(x_row, start + 3 * QUARTER, i, w3, vocab, width, temperature, best, at, m, es,
                                    SCALE, LSE, DRAW)
    if DRAW:
        tl.store(best_ptr + r * n_chunks + c, best)
        tl.store(index_ptr + r * n_chunks + c, at)
    if LSE:
        tl.store(max_ptr + r * n_chunks + c, m)
        tl.store(sum_ptr + r * n_chunks + c, es)


@triton.jit
def _pick_kernel(best_ptr, index_ptr, out_ptr, max_ptr, sum_ptr, lse_ptr, n_chunks, NCP: tl.constexpr,
                 LSE: tl.constexpr, DRAW: tl.constexpr = True):
    r = tl.program_id(0)
    c = tl.arange(0, NCP)
    if DRAW:
        s = tl.load(best_ptr + r * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        k = tl.argmax(s, 0, tie_break_left=True)
        tl.store(out_ptr + r, tl.load(index_ptr + r * n_chunks + k).to(tl.int64))
    if LSE:
        cm = tl.load(max_ptr + r * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        cz = tl.load(sum_ptr + r * n_chunks + c, mask=c < n_chunks, other=0.0)
        m = tl.max(cm, 0)
        tl.store(lse_ptr + r, m + tl.log(tl.sum(cz * tl.exp(cm - _shift(m)), 0)))


def gumbel_sample_triton(logits: torch.Tensor, seed: torch.Tensor, temperature: float, vocab_size: int,
                         rows: torch.Tensor | None = None, *, quarter: int = QUARTER, num_warps: int = NUM_WARPS,
                         lse: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n]: one token per row of logits [n, V] from its first min(V, vocab_size) (module docstring). seed: one
    int64 on logits' device (the key; read on the device, no host synchronisation); rows: int32/int64 [n] on the same
    device, each row's id in the counter (default 0..n-1). quarter and num_warps: another layout (a power of two;
    another quarter draws other tokens: tools/bench/bench_sampler.py --layouts). lse: fp32 [n] on the same device,
    filled with each row's log-sum-exp over all V logits in the same pass (module docstring)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or min(logits.shape[1], vocab_size) < 1:
        raise ValueError(f"gumbel_sample: logits must be [rows, vocab >= 1] with unit stride over the vocabulary and "
                         f"vocab_size >= 1, got shape {tuple(logits.shape)} strides {logits.stride()}, vocab_size "
                         f"{vocab_size}")
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != logits.device:
        raise ValueError(f"gumbel_sample: the seed must be one int64 on {logits.device}, got {seed.dtype} "
                         f"{tuple(seed.shape)} on {seed.device}")
    if rows is not None and (rows.shape != logits.shape[:1] or rows.device != logits.device
                             or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"gumbel_sample: rows must be one int32/int64 id per logits row on {logits.device}, got "
                         f"{rows.dtype} {tuple(rows.shape)} on {rows.device}")
    if lse is not None and (lse.shape != logits.shape[:1] or lse.dtype != torch.float32
                            or lse.device != logits.device):
        raise ValueError(f"gumbel_sample: lse must be fp32 [{logits.shape[0]}] on {logits.device}, got {lse.dtype} "
                         f"{tuple(lse.shape)} on {lse.device}")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch(logits, seed, temperature, vocab_size, rows, quarter, num_warps, out, lse)
    return out


def row_logsumexp_triton(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [n]: each row's log-sum-exp over all V logits of [n, V] (unit stride over V), as `gumbel_sample_triton`'s
    lse= gives it, without the draws: the same launch with the sampling compiled out (DRAW), whose log-sum-exp is
    the same ops in the same layout (the same bits: tests/rollout/test_sampling.py, on the GPU)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] < 1:
        raise ValueError(f"row_logsumexp: logits must be [rows, vocab >= 1] with unit stride over the vocabulary, "
                         f"got shape {tuple(logits.shape)} strides {logits.stride()}")
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _launch(logits, None, 1.0, logits.shape[1], None, QUARTER, NUM_WARPS, None, lse)
    return lse


def _launch(logits, seed, temperature, vocab_size, rows, quarter, num_warps, out, lse) -> None:
    """The two launches: tokens into `out` (None: the log-sum-exp alone, DRAW off) and, given `lse`, each row's
    log-sum-exp into it."""
    ensure_interpreter_compat()
    n = logits.shape[0]
    if n == 0:
        return
    vocab = min(logits.shape[1], vocab_size)
    width = logits.shape[1] if lse is not None else vocab  # the logits a chunk reads
    chunks = cdiv(width, 4 * quarter)
    draw = out is not None
    parts = torch.empty(2, n, chunks, dtype=torch.float32, device=logits.device) if lse is not None else None
    if draw:
        best = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)
        index = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    else:  # (lse given) unread pointers
        best = index = parts[0]
    parts = (best, best) if parts is None else parts  # unread without lse
    has_rows = rows is not None
    seed = best if seed is None else seed  # unread without draws
    launcher(_chunk_best_kernel)[(n, chunks)](
        logits, logits.stride(0), rows if has_rows else seed, seed, best, index, parts[0], parts[1], vocab, width,
        chunks, float(temperature), HAS_ROWS=has_rows, SCALE=temperature != 1.0, QUARTER=quarter,
        LSE=lse is not None, DRAW=draw, num_warps=num_warps)
    launcher(_pick_kernel)[(n,)](best, index, best if out is None else out, parts[0], parts[1],
                                 best if lse is None else lse, chunks, NCP=max(2, next_power_of_2(chunks)),
                                 LSE=lse is not None, DRAW=draw, num_warps=1)
