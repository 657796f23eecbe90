"""Batch-invariant forward ops for strict mode: every output element is a fixed function of its own inputs.

Why the default ops are not enough. A forward op is batch invariant when row i of its output does not depend on
which other rows share the call. The learner scores a sequence in one forward over [B*T] rows; the rollout computes
the same positions in a prefill and then one decode step at a time over [B] rows. Library kernels choose their
reduction order by shape: a GEMM blocks K differently at M=1 than at M=512, a CPU vector loop sends the last
`numel % 2*width` elements of a thread's chunk through a scalar tail (std::exp / std::cos instead of the SLEEF
vector version, which differ in the last ulp), a softmax over 7 keys takes the scalar path and one over 12 keys the
vector path. Measured here (CPU, tiny model, BF16): the MoE experts' torch matmuls at different M already differ
by 3.8e-6 (`minite diagnose`, docs/alignment.md).

What these ops guarantee. Each op is written with elementwise IEEE-754 basic operations only (+, -, *, /, sqrt,
comparisons, round/floor, integer bit manipulation) and explicit reductions:
  * IEEE-754 requires +, -, *, /, sqrt to be correctly rounded, so the vector and scalar code paths of a torch
    elementwise kernel give the same bits, on any thread split, on CPU and on CUDA (PyTorch builds without fast
    math; two separate torch ops are never contracted into an FMA). One measured exception to the premise, not to
    the conclusion: torch 2.13's fp32 sqrt on this project's CPU is not always correctly rounded (one ulp off for
    some inputs), but its vector and scalar paths give the same bits (tests/strict/test_fused.py), so strict mode
    still agrees with itself on a CPU; CUDA's sqrt is correctly rounded. And one trap: torch's CUDA division of a
    tensor by a Python number computes t * (1 / n), not t / n, so these ops divide by tensors (as rms_norm's mean).
  * `tree_sum` reduces a dim by adjacent pairs, (x0+x1), (x2+x3), ..., then pairs of pairs, after zero padding
    to a power of two. The tree depends only on absolute positions, and x + 0 == x exactly, so summing the first
    n keys of a length-12 row and of a length-7 row gives the same bits when the extra keys carry zeros. That is
    what lets a decode step (keys 0..t) and the full-sequence forward (keys 0..T-1, causally zeroed past t) agree.
  * exp, sin and cos are polynomials in float64 after an exact range reduction (Cody-Waite constants whose products
    with the reduction integer are exact), with 2^n built from exponent bits; the fp64 result (error ~1e-16 relative)
    is rounded once to fp32. They are deterministic functions, so equal inputs give equal outputs everywhere. The
    fp32 value is the correctly rounded exp/sin/cos except when the true value lies within ~1e-16 relative of an
    fp32 rounding boundary (then it may be the other neighbour: an accuracy matter only, never an invariance one).
  * max is exact in any order; top-k is a stable descending sort (ties keep the lower expert index).
So for equal inputs every strict op returns equal outputs, independent of batch size, row position, sequence
length, thread count and code path: guaranteed, not "almost surely", on any device whose torch elementwise
kernels are IEEE-conformant (CPU; CUDA without fast math). Nothing here assumes anything about library GEMMs,
softmax or reduction kernels.

On CUDA, BF16/FP16 GEMMs take one exception: `minite.strict.triton_gemm.matmul_fixed_k`, a Triton kernel with a
sequential K loop in constant blocks (its tile, picked by shape, changes no bit), batch invariant because every row runs
the same chain of MMAs (measured bitwise on the GPU by the GPU tests) rather than by IEEE rules alone; the tree GEMM
below was 4.8x slower than cuBLAS per decode step there.

Measured on this CPU (AVX512, torch 2.13): torch's own silu on the first n elements of a tensor differed from the
same elements computed inside the whole tensor in 29 places over n = 1..63 (vector body vs scalar tail); the
strict versions never differ (tests/strict/test_strict_ops.py).

Cost. The GEMM materialises x_i * w_j products [rows, cols, K] (chunked to bounded memory) and reduces them in
log2(K) elementwise passes: K times the memory traffic of a GEMM, fine for the tiny CPU model and for decode-size
M, not a training-throughput path. Backward (only forward values must agree): the linear's is ordinary matmuls,
and every other op under autograd records one node (`_StrictForward`) whose gradient is the same function's in
torch's ops, so the learner's backward never runs through the strict graphs.
"""
from __future__ import annotations

import math

import torch

from . import fused, fused_attention, fused_linear, fused_log_softmax, triton_gemm

_CHUNK_ELEMS = 1 << 24  # products held at once by `linear` and `attention` (64 MiB of fp32)

# exp: n = round(x / ln2); r = x - n*ln2_hi - n*ln2_lo (ln2_hi has 32 significant bits: n*ln2_hi is exact)
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(14)]  # |r| <= 0.35: truncation ~4e-18
# sin/cos: n = round(x * 2/pi); r = x - n*(p1 + p2 + p3), p1 and p2 with 33 significant bits (exact for |n| < 2^20)
_TWO_OVER_PI = 0.6366197723675814
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624879595063154e-21
_SIN_COEFFS = [(-1) ** k / math.factorial(2 * k + 1) for k in range(11)]  # |r| <= pi/4
_COS_COEFFS = [(-1) ** k / math.factorial(2 * k) for k in range(12)]


# log: x = 2^e * m with m in [sqrt(1/2), sqrt(2)) from the bits; log m = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172
_SQRT2 = 1.4142135623730951
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(12)]  # s^2k / (2k+1): truncation ~1e-20


def _horner(z: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    """sum_i coeffs[i] * z^i, evaluated from the highest power down (fixed order)."""
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2.0**n in float64 for integer-valued n in [-1022, 1023], from the exponent bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


class _StrictForward(torch.autograd.Function):
    """A strict op under autograd: its value computed with nothing recorded, its gradient that of `plain` (the same
    function in ordinary torch ops), recomputed from the saved inputs in the backward. Only forward values have to
    agree across engines (the learner's log-probs and the rollout's); the graph of the strict ops themselves, fp64
    polynomials and pair trees of dozens of elementwise passes, cost the learner's backward as many launches and kept
    every intermediate alive until then (attention: each chunk of its [queries, keys, dim] products). With nothing
    recorded, `fused.routes` also sends the forward to the op's kernel on a GPU (the same bits)."""

    @staticmethod
    def forward(ctx, strict, plain, *inputs):
        ctx.plain = plain
        ctx.save_for_backward(*inputs)
        return strict(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need)]
            out = ctx.plain(*leaves)
            grads = iter(torch.autograd.grad(out, [t for t, n in zip(leaves, need) if n], grad.to(out.dtype),
                                             allow_unused=True))
        return (None, None, *(next(grads) if n else None for n in need))


def _records(*tensors: torch.Tensor) -> bool:
    """Autograd would record an op on these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32 (see the module docstring); -inf -> 0, NaN -> NaN, overflow -> inf. On CUDA with
    `fused.ENABLED`: the same operations in one Triton kernel (the same bits, proven on the H200)."""
    if fused.routes(x, kernel="exp"):
        return fused.exp(x)
    x64 = x.double()
    xc = torch.nan_to_num(x64, nan=0.0).clamp(-150.0, 89.0)  # fp32 exp is 0 below -104, inf above 88.8
    n = torch.round(xc * _LOG2E)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    y = (_horner(r, _EXP_COEFFS) * _pow2(n)).float()
    y = torch.where(x64 < -150.0, torch.zeros_like(y), y)
    y = torch.where(x64 > 89.0, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x64), torch.full_like(y, math.nan), y)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float32 for finite |x| < 2^20 (RoPE angles: position * inverse frequency). On CUDA, fp32,
    with "sincos" in `fused.PROVEN`: the same operations in one Triton kernel."""
    if x.numel() and float(x.abs().max()) >= 2.0 ** 20:  # the max of |x| is exact in x's dtype: the same test
        raise ValueError("strict sincos: |x| >= 2^20 is outside the exact range reduction")
    if x.dtype == torch.float32 and fused.routes(x, kernel="sincos"):
        return fused.sincos(x)
    x64 = x.double()
    n = torch.round(x64 * _TWO_OVER_PI)
    r = ((x64 - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3
    z = r * r
    s = r * _horner(z, _SIN_COEFFS)
    c = _horner(z, _COS_COEFFS)
    q = torch.remainder(n.to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin.float(), cos.float()


def _log_fwd(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float64 and fused.routes(x, kernel="log"):  # inside _StrictLog.forward no gradient is recorded
        return fused.log(x)
    x64 = x.double()
    bits = x64.clamp(min=2.0 ** -1022).view(torch.int64)  # normal numbers only (log-softmax sums are >= 1)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int64)).double()
    t = (m - 1.0) / (m + 1.0)
    y = e * _LN2_HI + (e * _LN2_LO + 2.0 * t * _horner(t * t, _ATANH_COEFFS))
    y = torch.where(x64 == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(torch.isinf(x64) & (x64 > 0), torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x64) | (x64 < 0), torch.full_like(y, math.nan), y).float()


class _StrictLog(torch.autograd.Function):
    """The bit extraction has no gradient; d log x / dx = 1 / x is supplied here."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _log_fwd(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / x.float()


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float32 (fp64 polynomial from the exponent and mantissa bits, rounded once)."""
    return _StrictLog.apply(x)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x - max - log(tree_sum(exp(x - max))) in fp32 (rows of any batch give the same bits). Under autograd: the
    gradient of torch.log_softmax (`_StrictForward`)."""
    if _records(x):
        return _StrictForward.apply(lambda a: log_softmax(a, dim), lambda a: torch.log_softmax(a.float(), dim), x)
    x = x.float()
    m = x.amax(dim=dim, keepdim=True).detach()
    z = x - m
    return z - log(tree_sum(exp(z), dim)).unsqueeze(dim)


def token_log_softmax(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log_softmax(x, -1)[r, idx[r]] for x [R, V] and int64 idx [R]: fp32 [R], what a sampler keeps of the
    log-softmax. On CUDA with "log_softmax" in `fused.PROVEN` and no gradient to record: three launches
    (`fused_log_softmax`, the same bits) instead of the whole [R, V] log-softmax. idx must lie in [0, V) (the
    torch ops raise otherwise, the kernels give NaN). Under autograd: the gradient of torch.log_softmax's, gathered
    (`_StrictForward`), the value as without (on a GPU the kernels' then too)."""
    if _records(x):
        return _StrictForward.apply(token_log_softmax, _plain_token_log_softmax, x, idx)
    if fused_log_softmax.applies(x, idx) and fused.routes(x, kernel="log_softmax"):
        return fused_log_softmax.token_log_softmax(x, idx)
    return log_softmax(x, -1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _plain_token_log_softmax(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), -1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by adjacent pairs after zero padding to a power of two (the order depends on positions only).
    On CUDA with `fused.ENABLED`, float32: one Triton kernel, the same additions (proven on the H200)."""
    if x.dtype == torch.float32 and x.dim() and fused.routes(x, width=x.shape[dim], kernel="tree_sum"):
        return fused.tree_sum(x, dim)
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], width - n)], dim=-1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _linear_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] -> fp32 [M, N]: fp32 products, tree_sum over K; chunked over rows and columns (each output
    element is computed alone, so chunking changes nothing). On CUDA with K <= `fused.MAX_WIDTH`: the same products
    and tree in one Triton kernel (`fused_linear`, "linear" in `fused.PROVEN`), nothing materialised."""
    m, k = x.shape
    n = w.shape[0]
    if torch.float64 not in (x.dtype, w.dtype) and fused_linear.applies(n, k) and \
            fused.routes(x, w, width=k, kernel="linear"):
        return fused_linear.linear(x, w)
    width = 1 << max(k - 1, 0).bit_length()
    cols = max(1, min(n, _CHUNK_ELEMS // max(width, 1)))
    rows = max(1, _CHUNK_ELEMS // (cols * max(width, 1)))
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    xf, wf = x.float(), w.float()
    for i in range(0, m, rows):
        for j in range(0, n, cols):
            prod = xf[i:i + rows, None, :] * wf[None, j:j + cols, :]
            out[i:i + rows, j:j + cols] = tree_sum(prod, -1)
    return out


class _StrictLinear(torch.autograd.Function):
    """Forward: `_linear_fwd`; backward: ordinary matmuls (only forward values have to agree across engines)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        if triton_gemm.available(x, w):  # CUDA bf16/fp16: the fixed-K tensor-core kernel (see triton_gemm)
            return triton_gemm.matmul_fixed_k(x, w)
        return _linear_fwd(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ w^T over the last dim of x, batch invariant; fp32 unless out_dtype says otherwise."""
    lead = x.shape[:-1]
    y = _StrictLinear.apply(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[0]).to(out_dtype or torch.float32)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax in fp32: exact max, strict exp, tree_sum denominator, one IEEE division per element. Under autograd:
    the gradient of torch.softmax (`_StrictForward`)."""
    if _records(x):
        return _StrictForward.apply(lambda a: softmax(a, dim), lambda a: torch.softmax(a.float(), dim), x)
    x = x.float()
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an all -inf row: every e is 0 (caller's problem)
    e = exp(x - m)
    return e / tree_sum(e, dim).unsqueeze(dim)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = x / (1 + exp(-x)) in fp32. Under autograd: the gradient of torch's silu (`_StrictForward`)."""
    if _records(x):
        return _StrictForward.apply(silu, lambda a: torch.nn.functional.silu(a.float()), x)
    x = x.float()
    return x / (1.0 + exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 inside, output in x's dtype. On CUDA with
    `fused.ENABLED`: one Triton kernel, the same operations (proven on the H200). Under autograd: the gradient of
    the same formula in torch's ops (`_StrictForward`)."""
    if _records(x, weight):
        return _StrictForward.apply(lambda a, w: rms_norm(a, w, eps), lambda a, w: _plain_rms_norm(a, w, eps), x,
                                    weight)
    if x.dim() and fused.routes(x, weight, width=x.shape[-1], kernel="rms_norm"):
        return fused.rms_norm(x, weight, eps)
    xf = x.float()
    s = tree_sum(xf * xf, -1)
    ms = s / torch.full_like(s, xf.shape[-1])  # a tensor divisor: torch's CUDA `t / python_number` is t * (1 / n)
    inv = 1.0 / torch.sqrt(ms + eps)
    return ((xf * inv.unsqueeze(-1)) * weight.float()).to(x.dtype)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, q [sq, b, h, d], k/v [sk, b, g, d] with g dividing h (grouped-query attention: query head
    i reads KV head i // (h / g), as Megatron's repeat_interleave of the groups) -> [sq, b, h, d] fp32.

    Query i sits at absolute position sk - sq + i and sees keys 0..that position; keys past it get probability
    exactly 0. Scores are tree sums over d; the softmax denominator and the context are tree sums over keys at
    absolute key positions, so a decode step (sq = 1) and a full forward give the same bits. Under autograd: the
    gradient of torch's scaled_dot_product_attention with the same mask (`_StrictForward`).
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3] or \
            k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"strict attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if _records(q, k, v):
        return _StrictForward.apply(lambda *t: attention(*t, scale), lambda *t: _plain_attention(*t, scale), q, k, v)
    if fused_attention.routable(q, k) and fused.routes(q, k, v, kernel="attention"):
        return fused_attention.attention(q, k, v, scale)
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    sq, sk = q.shape[0], k.shape[0]
    qf, kf, vf = q.float(), k.float(), v.float()
    kt = kf.permute(1, 2, 0, 3)          # [b, h, sk, d]
    vt = vf.permute(1, 2, 3, 0)          # [b, h, d, sk]
    per_query = max(1, kt.numel() * 2)
    step = max(1, _CHUNK_ELEMS // per_query)
    outs = []
    for i0 in range(0, sq, step):
        qi = qf[i0:i0 + step]            # [c, b, h, d]
        scores = tree_sum(qi[:, :, :, None, :] * kt[None], -1) * scale  # [c, b, h, sk]
        pos = (sk - sq) + torch.arange(i0, i0 + qi.shape[0], device=q.device)
        allowed = torch.arange(sk, device=q.device)[None, :] <= pos[:, None]  # [c, sk]
        allowed = allowed[:, None, None, :]
        m = scores.masked_fill(~allowed, -math.inf).amax(-1, keepdim=True)
        e = torch.where(allowed, exp(scores - m), torch.zeros_like(scores))
        p = e / tree_sum(e, -1).unsqueeze(-1)
        outs.append(tree_sum(p[:, :, :, None, :] * vt[None], -1))       # [c, b, h, d]
    return torch.cat(outs, dim=0)


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` in torch's ops (fp32): query i sees keys 0..sk - sq + i."""
    sq, sk = q.shape[0], k.shape[0]
    qf, kf, vf = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]; query head i reads KV
    gqa = q.shape[2] != k.shape[2]  # head i // (heads / groups), as `attention`
    if sq == sk:  # the learner's whole sequences: the causal flag lets torch pick its memory-efficient kernel
        ctx = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos = (sk - sq) + torch.arange(sq, device=q.device)
        allowed = torch.arange(sk, device=q.device)[None, :] <= pos[:, None]
        ctx = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale,
                                                               enable_gqa=gqa)
    return ctx.permute(2, 0, 1, 3)


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the last dim by a stable descending sort: ties go to the lower index, on every device."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


_ROPE_CACHE: list = []  # (a tensor holding the table's storage, its storage key, version, sin, cos), newest first
_ROPE_TABLE_MAX_ELEMS = 1 << 23  # larger storages are not cached whole (per-call sincos, as without a cache)


def _storage_key(t: torch.Tensor) -> tuple:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes(), t.dtype, t.device


def _version(t: torch.Tensor):
    """The version counter (shared by a view and its base), or None for an inference tensor (none is kept)."""
    return None if t.is_inference() else t._version


def _rope_sincos(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sincos(freqs), memoised per RoPE table: Megatron hands every layer (queries and keys) a view of one cached
    table (RotaryEmbedding's lru_cache), so sin/cos are computed once over the table's whole storage and each call
    takes the same view of them. sincos is elementwise, so the view of sincos(table) is bitwise sincos(view).

    The key is the storage itself (its address, size, dtype and device; the entry holds a tensor on it, so the
    address cannot be reused while cached) plus the version counter where torch keeps one. No value comparison:
    torch.equal was one host synchronisation per call on a GPU (two per layer and decode step). The one assumption:
    nobody writes into the RoPE table in place under torch.inference_mode (inference tensors keep no version
    counter; Megatron never writes into it). A storage too large to cache whole, or whose values outside the view
    fail sincos' range check, is computed per call."""
    key, ver = _storage_key(freqs), _version(freqs)
    for holder, k, v, sin, cos in _ROPE_CACHE:
        if k == key and v == ver:
            return (sin.as_strided(freqs.shape, freqs.stride(), freqs.storage_offset()),
                    cos.as_strided(freqs.shape, freqs.stride(), freqs.storage_offset()))
    n = key[1] // freqs.element_size()
    if n > _ROPE_TABLE_MAX_ELEMS:
        return sincos(freqs)
    whole = freqs.detach().as_strided((n,), (1,), 0)
    try:
        sin, cos = sincos(whole)
    except ValueError:  # the storage holds angles outside the range reduction: check and compute the view alone
        return sincos(freqs)
    _ROPE_CACHE.insert(0, (freqs.detach(), key, ver, sin, cos))
    del _ROPE_CACHE[4:]
    return (sin.as_strided(freqs.shape, freqs.stride(), freqs.storage_offset()),
            cos.as_strided(freqs.shape, freqs.stride(), freqs.storage_offset()))


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Rotary embedding with strict sin/cos, non-interleaved halves (Megatron's and Qwen3's layout): the first
    freqs.shape[-1] channels of t are rotated by the angles `freqs`, the rest pass through."""
    if freqs.requires_grad:
        raise ValueError("strict rope: the angles take no gradient (freqs.requires_grad is set)")
    if _records(t):  # the rotation's own torch ops give the gradient (`_StrictForward`); the angles take none
        return _StrictForward.apply(lambda a: rope(a, freqs, mscale),
                                    lambda a: _rotate(a, *_rope_sincos(freqs), mscale), t)
    sin, cos = _rope_sincos(freqs)
    if fused.routes(t, freqs, kernel="rope") and fused.rope_applies(t, freqs):
        return fused.rope(t, sin, cos, mscale)
    return _rotate(t, sin, cos, mscale)


def _rotate(t: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mscale: float) -> torch.Tensor:
    rot = sin.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos_, sin_ = (cos * mscale).to(t.dtype), (sin * mscale).to(t.dtype)
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat(((t_rot * cos_) + (rotated * sin_), t_pass), dim=-1)
