"""A decode step's queries and keys in one launch, with the bits of the ops it replaces (megatron_patches.rope).

Megatron-Core 0.16.1 prepares a self-attention's queries and keys in nine launches per layer and decode step (the
rollout slice, session 42's trace: ~17.6 us of kernels and ~4 us of gaps at batch 64 on an H100):

    query = q_layernorm(split(mixed_qkv).reshape(...))    a copy (the reshape of a strided split), torch's RMSNorm
    key = k_layernorm(split(mixed_qkv))                   a copy (rms_norm makes its input contiguous), RMSNorm
    key = rope(key); K[pos] = key; V[pos] = value         miniTE's roped cache: RoPE, two copies into the cache
    query = rope(query)                                   RoPE (minite.kernels.megatron_rope; the ninth: a memset)

Here one program per (position, batch row, query group) reads its group's rep + 2 head rows of mixed_qkv once and
writes the group's normalised, rotated queries into a new [s, b, heads, d] tensor and its normalised, rotated key
and its value into the cache rows of the position.

torch's CUDA RMSNorm, as this kernel computes it (torch 2.11, aten/src/ATen/native/cuda/layer_norm_kernel.cu:
`vectorized_layer_norm_kernel` with rms_norm, which torch runs for rows of bf16 whose width is a multiple of 4 in
8-byte-aligned buffers; the trace names it):
    a block of 128 threads (4 warps of 32) per row; thread t reads the 4-element vectors t, t + 128, ... and adds
    their squares in order into an fp32 sum, s = s + x * x (nvcc contracts it to an FMA; here tl.fma, on the CPU
    x * x is exact in fp32 for a bf16 x, so the two round alike but where x * x is below fp32's normal range);
    each warp sums its lanes by shuffles: for offset 16, 8, 4, 2, 1 lane j adds lane j + offset; then warp 0 adds
    warp 2 and warp 1 warp 3, and warp 0 adds warp 1;
    mean = s / d (IEEE division), rstd = rsqrtf(mean + eps), y = bf16(weight * (rstd * x)).
A head of up to 512 elements gives each thread one vector at most (a head of 128: warp 0's lanes, the others add
zeros), which is what this kernel covers. RoPE is megatron_rope's (`angles`, `rotate`): cos and sin of the fp32
angle through libdevice, times mscale, each to bf16; out = bf16(bf16(y * cos) + bf16(rotate_half(y) * sin)).

Whether that is bitwise torch's and Megatron's on a GPU (rsqrtf against libdevice's rsqrt, the shuffle order) is a
GPU fact: tests/kernels/test_qk_norm_rope.py compares the kernel with torch.rms_norm and Megatron's RoPE on the GPU
(marker gpu); until it has passed there the kernel waits (`minite.strict.fused.WAITS_FOR`). On the CPU, `reference`
computes the same order in torch ops and the interpreted kernel is compared with it bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import launcher, next_power_of_2
from .megatron_rope import angles, math_functions, rotate
from .nvfp4_swiglu import _round_bf16

THREADS = 128
"""torch's block for a row (32 x 4 threads), each reading 4-element vectors."""
MAX_HEAD = 4 * THREADS
"""The widest head this kernel computes: one vector per thread."""


@triton.jit
def _pair_halves(s, W: tl.constexpr, L: tl.constexpr, R: tl.constexpr):
    """[R, W, 2 * L] -> [R, W, L]: element j plus element j + L (a shuffle-down step of offset L)."""
    s = tl.permute(tl.reshape(s, [R, W, 2, L]), (0, 1, 3, 2))
    a, b = tl.split(s)
    return a + b


@triton.jit
def _torch_rms(row_ptrs, d_mask_rows, eps, D: tl.constexpr, R: tl.constexpr, MATH: tl.constexpr):
    """rstd [R] of R rows (pointers [R, 1] to each row's first element) in torch's order (module docstring)."""
    t = tl.arange(0, 128)[None, :]
    ok = d_mask_rows & (t * 4 < D)
    s = tl.zeros([R, 128], dtype=tl.float32)
    for i in tl.static_range(4):
        x = tl.load(row_ptrs + t * 4 + i, mask=ok, other=0.0).to(tl.float32)
        s = tl.fma(x, x, s)
    s = tl.reshape(s, [R, 4, 32])
    s = _pair_halves(s, 4, 16, R)
    s = _pair_halves(s, 4, 8, R)
    s = _pair_halves(s, 4, 4, R)
    s = _pair_halves(s, 4, 2, R)
    s = _pair_halves(s, 4, 1, R)  # [R, 4, 1]: each warp's lane 0
    w = tl.reshape(s, [R, 1, 4])
    w = _pair_halves(w, 1, 2, R)  # warp 0 + warp 2, warp 1 + warp 3
    w = _pair_halves(w, 1, 1, R)  # [R, 1, 1]
    mean = tl.div_rn(tl.reshape(w, [R]), tl.full([R], D, tl.float32))
    return MATH(mean + eps, "rsqrt")


@triton.jit
def _norm_rope(src_ptrs, rows_ok, w_ptr, eps, c, sn, dd, HALF: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               MATH: tl.constexpr):
    """The rows' normalised (bf16), rotated values [R, D] (module docstring)."""
    rstd = _torch_rms(src_ptrs, rows_ok, eps, D, R, MATH)[:, None]
    pd = (dd + HALF) % D
    x = tl.load(src_ptrs + dd, mask=rows_ok, other=0.0).to(tl.float32)
    xp = tl.load(src_ptrs + pd, mask=rows_ok, other=0.0).to(tl.float32)
    y = _round_bf16(tl.load(w_ptr + dd).to(tl.float32) * (rstd * x))
    yp = _round_bf16(tl.load(w_ptr + pd).to(tl.float32) * (rstd * xp))
    return rotate(y, yp, c, sn, dd, HALF).to(tl.bfloat16)  # exact: a bf16 value


@triton.jit
def _qk_norm_rope_kernel(m_ptr, sm_s, sm_b, sm_g, q_ptr, sq_s, sq_b, sq_h, k_ptr, v_ptr, sk_s, sk_b, sk_g,
                         sv_s, sv_b, sv_g, fq_ptr, sfq, fk_ptr, sfk, wq_ptr, wk_ptr, eps_q, eps_k, mscale, B, G,
                         REP: tl.constexpr, REP_B: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                         ONE_TABLE: tl.constexpr, MATH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    g = pid % G
    b = (pid // G) % B
    s = pid // (G * B)
    dd = tl.arange(0, D)[None, :]
    group = m_ptr + s * sm_s + b * sm_b + g * sm_g  # [q_0 .. q_rep-1, k, v] rows of D
    cq, snq = angles(tl.load(fq_ptr + s * sfq + dd), mscale, MATH)
    if ONE_TABLE:  # the keys' angles are the queries' (Megatron hands both the same table)
        ck, snk = cq, snq
    else:
        ck, snk = angles(tl.load(fk_ptr + s * sfk + dd), mscale, MATH)
    h = tl.arange(0, REP_B)[:, None]
    q_ok = h < REP
    q = _norm_rope(group + h * D, q_ok, wq_ptr, eps_q, cq, snq, dd, HALF, D, REP_B, MATH)
    tl.store(q_ptr + s * sq_s + b * sq_b + (g * REP + h) * sq_h + dd, q, mask=q_ok & (dd < D))
    one = tl.arange(0, 1)[:, None]
    k = _norm_rope(group + REP * D + one * 0, one == 0, wk_ptr, eps_k, ck, snk, dd, HALF, D, 1, MATH)
    tl.store(k_ptr + s * sk_s + b * sk_b + g * sk_g + one * 0 + dd, k)
    v = tl.load(group + (REP + 1) * D + dd)
    tl.store(v_ptr + s * sv_s + b * sv_b + g * sv_g + dd, v)


def heads_apply(rep: int, head: int) -> bool:
    """Whether the kernel takes groups of rep query heads of `head` elements: rep >= 1, a head of 4..MAX_HEAD
    elements, a power of two (RoPE over the whole head, torch's vectors of 4, one vector a thread)."""
    return rep >= 1 and 4 <= head <= MAX_HEAD and head & (head - 1) == 0


def applies(mixed: torch.Tensor, rep: int, head: int) -> bool:
    """Whether the kernel computes this call: bf16 mixed_qkv [s, b, groups, (rep + 2) * head] with unit stride over
    its last dim, and `heads_apply`."""
    return (mixed.dtype == torch.bfloat16 and mixed.dim() == 4 and mixed.stride(-1) == 1
            and mixed.shape[-1] == (rep + 2) * head and heads_apply(rep, head))


def qk_norm_rope_cache(mixed: torch.Tensor, rep: int, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float,
                       k_eps: float, q_freqs: torch.Tensor, k_freqs: torch.Tensor, mscale: float,
                       key_out: torch.Tensor, value_out: torch.Tensor) -> torch.Tensor:
    """The queries [s, b, groups * rep, d] (new, contiguous): normalised with q_weight, rotated by q_freqs [s, 1, 1, d]
    (fp32); each group's key normalised with k_weight and rotated by k_freqs into key_out [s, b, groups, d], its
    value copied into value_out (views of the KV cache's rows for these positions). mixed: the QKV projection's
    output viewed as [s, b, groups, (rep + 2) * d], each group's rep query heads, then its key, then its value."""
    s, b, g, width = mixed.shape
    d = width // (rep + 2)
    if not applies(mixed, rep, d):
        raise ValueError(f"qk_norm_rope: bf16 mixed_qkv [s, b, groups, (rep + 2) * d] with d a power of two in "
                         f"4..{MAX_HEAD}, got {tuple(mixed.shape)} {mixed.dtype} with rep {rep}")
    for name, t, shape in (("key_out", key_out, (s, b, g, d)), ("value_out", value_out, (s, b, g, d)),
                           ("q_freqs", q_freqs, (s, 1, 1, d)), ("k_freqs", k_freqs, (s, 1, 1, d)),
                           ("q_weight", q_weight, (d,)), ("k_weight", k_weight, (d,))):
        want = torch.float32 if "freqs" in name else torch.bfloat16
        if tuple(t.shape) != shape or t.dtype != want or t.stride(-1) != 1 or t.device != mixed.device:
            raise ValueError(f"qk_norm_rope: {name} must be {want} {shape} on {mixed.device} with unit stride over "
                             f"its last dim, got {t.dtype} {tuple(t.shape)} on {t.device}")
    ensure_interpreter_compat()
    query = torch.empty(s, b, g * rep, d, dtype=mixed.dtype, device=mixed.device)
    if query.numel():
        launcher(_qk_norm_rope_kernel)[(s * b * g,)](
            mixed, mixed.stride(0), mixed.stride(1), mixed.stride(2), query, query.stride(0), query.stride(1),
            query.stride(2), key_out, value_out, key_out.stride(0), key_out.stride(1), key_out.stride(2),
            value_out.stride(0), value_out.stride(1), value_out.stride(2), q_freqs, q_freqs.stride(0), k_freqs,
            k_freqs.stride(0), q_weight, k_weight, float(q_eps), float(k_eps), float(mscale), b, g, REP=rep,
            REP_B=next_power_of_2(rep), D=d, HALF=d // 2,
            ONE_TABLE=q_freqs.data_ptr() == k_freqs.data_ptr() and q_freqs.stride(0) == k_freqs.stride(0),
            MATH=math_functions(), num_warps=4, enable_fp_fusion=False)
    return query


def torch_order_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's CUDA RMSNorm of rows of up to MAX_HEAD bf16 elements in the order of the module docstring, in torch
    ops (the CPU reference of the kernel's norm): per thread the sum of its vector's squares in order, the lanes'
    shuffle tree, the warps' tree, then mean, 1 / sqrt (the interpreter's rsqrt: on the GPU rsqrtf is approximate)."""
    d = x.shape[-1]
    xf = x.float().reshape(-1, d)
    return (weight.float() * (torch_order_rstd(xf, eps)[:, None] * xf)).to(x.dtype).reshape(x.shape)


def torch_order_rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [rows] of `torch_order_rms_norm`'s rows xf [rows, d] (fp32 values of bf16 ones): rsqrt as the
    interpreter's 1 / sqrt, each correctly rounded (torch's CPU sqrt of fp32 is not always: computed in fp64, then
    rounded once, which for a square root is the correctly rounded fp32 one)."""
    d = xf.shape[-1]
    v = torch.zeros(xf.shape[0], THREADS * 4, dtype=torch.float32, device=xf.device)
    v[:, :d] = xf
    v = v.view(-1, THREADS, 4)
    s = torch.zeros(xf.shape[0], THREADS, dtype=torch.float32, device=xf.device)
    for i in range(4):
        s = s + v[..., i] * v[..., i]
    s = s.view(-1, 4, 32)
    for half in (16, 8, 4, 2, 1):
        s = s[..., :half] + s[..., half:2 * half]
    w = s[..., 0]
    w = w[:, :2] + w[:, 2:]
    mean = (w[:, 0] + w[:, 1]) / torch.tensor(float(d))
    return 1.0 / torch.sqrt((mean + torch.tensor(eps, dtype=torch.float32)).double()).float()


def reference(mixed: torch.Tensor, rep: int, q_weight, k_weight, q_eps, k_eps, q_freqs, k_freqs, mscale: float,
              cos=torch.cos, sin=torch.sin):
    """(query, key, value) of `qk_norm_rope_cache` in torch ops: `torch_order_rms_norm`, then Megatron's RoPE
    arithmetic (cos and sin passed in: on the CPU the interpreter's numpy functions)."""
    s, b, g, width = mixed.shape
    d = width // (rep + 2)
    q, k, v = torch.split(mixed, [rep * d, d, d], dim=3)
    q = torch_order_rms_norm(q.reshape(s, b, g * rep, d), q_weight, q_eps)
    k = torch_order_rms_norm(k, k_weight, k_eps)

    def rope(t, f):
        c, sn = (cos(f) * mscale).to(t.dtype), (sin(f) * mscale).to(t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return (t * c) + (torch.cat((-x2, x1), dim=-1) * sn)

    return rope(q, q_freqs), rope(k, k_freqs), v.contiguous()
