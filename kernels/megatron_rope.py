"""Megatron-Core's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd, non-interleaved) in one launch, same bits.

Megatron computes, for t [s, b, h, d] in bf16 and freqs [s, 1, 1, d] in fp32: cos_ = bf16(cos(freqs) * mscale),
sin_ = bf16(sin(freqs) * mscale), rot = cat(-t[..., d/2:], t[..., :d/2]), out = bf16(bf16(t * cos_) + bf16(rot *
sin_)) (each torch op on bf16 computes in fp32 and rounds once), then cat with the part of t past the rotary width.
That is about twelve launches per call, two calls per layer and decode step (queries and keys). Here one program
per (position, batch row) does the same operations on each element: the CUDA math library's cosf/sinf (libdevice's
__nv_cosf/__nv_sinf, the functions torch's float kernels call), the fp32 multiplies, each rounding to bf16 (the GPU
cast is round-to-nearest-even), no FMA contraction (the launch passes enable_fp_fusion=False). Whether that is
bitwise torch's is a GPU fact: tests/megatron_patches/test_rope_gpu.py compares it with Megatron's function on the
H200 (marker gpu). Used only on CUDA tensors without autograd (megatron_patches.rope): the learner's training
forward keeps Megatron's ops and their backward (a recompute run under no_grad would take the kernel: the same bits).
`angles` and `rotate` are that arithmetic, which kernels/qk_norm_rope.py calls too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from ._interpreter import interpreting
from ._launch import launcher, next_power_of_2
from .nvfp4_swiglu import _round_bf16


@triton.jit
def math_libdevice(x, FN: tl.constexpr):
    """cosf, sinf or rsqrtf as torch's CUDA kernels compute them (the CUDA math library's)."""
    if FN == "cos":
        return libdevice.cos(x)
    elif FN == "sin":
        return libdevice.sin(x)
    else:
        return libdevice.rsqrt(x)


@triton.jit
def math_interpreted(x, FN: tl.constexpr):
    """The same under the interpreter, which has no libdevice: numpy's cos, sin and 1 / sqrt."""
    if FN == "cos":
        return tl.cos(x)
    elif FN == "sin":
        return tl.sin(x)
    else:
        return tl.math.rsqrt(x)


def math_functions():
    """The MATH argument of the kernels that take one: the CUDA math library's, or numpy's in the interpreter."""
    return math_interpreted if interpreting() else math_libdevice


@triton.jit
def angles(f, mscale, MATH: tl.constexpr):
    """(cos_, sin_) of fp32 angles f as Megatron's RoPE takes them: bf16(cos(f) * mscale), bf16(sin(f) * mscale),
    held in fp32."""
    return _round_bf16(MATH(f, "cos") * mscale), _round_bf16(MATH(f, "sin") * mscale)


@triton.jit
def rotate(x, partner, c, sn, dd, HALF: tl.constexpr):
    """Megatron's RoPE of bf16 values x (in fp32) whose partners x[(d + HALF) % D] are `partner`, at columns dd:
    bf16(bf16(x * cos_) + bf16(rotate_half(x) * sin_)), in fp32 (module docstring)."""
    rot = tl.where(dd < HALF, partner * -1.0, partner)  # not -partner: Triton 3.6 negates as 0 - x (+0 for +0)
    return _round_bf16(_round_bf16(x * c) + _round_bf16(rot * sn))


@triton.jit
def _rope_kernel(t_ptr, f_ptr, y_ptr, B, H, st_s, st_b, st_h, sf_s, sy_s, sy_b, sy_h, mscale,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, MATH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    s, b = pid // B, pid % B
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, D)[None, :]
    mask = (hh < H) & (dd < D)
    c, sn = angles(tl.load(f_ptr + s * sf_s + dd), mscale, MATH)
    base = t_ptr + s * st_s + b * st_b + hh * st_h
    x = tl.load(base + dd, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(base + (dd + HALF) % D, mask=mask, other=0.0).to(tl.float32)
    y = rotate(x, partner, c, sn, dd, HALF)
    tl.store(y_ptr + s * sy_s + b * sy_b + hh * sy_h + dd, y.to(tl.bfloat16), mask=mask)  # exact: a bf16 value


def applies(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `rope` computes this call: bf16 t [s, b, h, d] on CUDA (contiguous along d), fp32 freqs [s, 1, 1, d]
    with d the whole head (no pass-through part), d a power of two."""
    return (t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 4 and t.stride(-1) == 1
            and freqs.dtype == torch.float32 and freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1
            and freqs.shape[0] == t.shape[0] and freqs.shape[-1] == t.shape[-1] and freqs.stride(-1) == 1
            and t.shape[-1] >= 2 and t.shape[-1] & (t.shape[-1] - 1) == 0 and freqs.device == t.device)


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Megatron's _apply_rotary_pos_emb_bshd(t, freqs, False, False, mscale) for the calls `applies` takes."""
    if not applies(t, freqs):
        raise ValueError(f"megatron_rope: bf16 CUDA t [s, b, h, d] and fp32 freqs [s, 1, 1, d], got t "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}, freqs {tuple(freqs.shape)} {freqs.dtype}")
    s, b, h, d = t.shape
    y = torch.empty(s, b, h, d, dtype=t.dtype, device=t.device)
    if y.numel():
        launcher(_rope_kernel)[(s * b,)](
            t, freqs, y, b, h, t.stride(0), t.stride(1), t.stride(2), freqs.stride(0), y.stride(0), y.stride(1),
            y.stride(2), float(mscale), D=d, HALF=d // 2, BLOCK_H=next_power_of_2(h), MATH=math_functions(),
            num_warps=4, enable_fp_fusion=False)
    return y
