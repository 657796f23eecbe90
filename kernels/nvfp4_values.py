"""fp16 block values (E2M1 code x E4M3 block scale) from packed NVFP4 codes, 1x16 blocks, in one launch.

The MoE learner keeps the wgrad operand x^T packed between its forward and backward (0.5625 B per element instead
of x's 2 B in bf16, minite.ops.grouped), and the wgrad GEMM reads fp16 block values: this kernel writes them from
the codes just before. Each value is the product the quantisation kernel writes when it keeps values
(kernels/nvfp4_quant.py `_quantize_tile`: (+-e2m1) x e4m3 in fp32, exact, rounded to fp16 exactly), so the values
are bitwise those the quantiser would have written, and `NVFP4Tensor.block_values(torch.float16)` of the reference up
to the sign of zero. The E4M3 decoding is kernels/nvfp4_encode.py `_e4m3_rne`'s (normal: bits ((e + 120) << 23) |
(m << 20); subnormal m x 2^-9; the NaN code 0x7F, which the quantisers write for a block of NaN scale, NaN); the
E2M1 magnitude index i is i / 2 below 2 and bits ((i >> 1) + 126) << 23 | (i & 1) << 22 from 2 up; a set sign bit
negates as 0 - x, so code 8 ("-0") gives +0, as the quantisers write it (the reference gives -0; docs/nvfp4.md,
"Zero and -0"). Elementwise: batch invariant by construction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher

BLOCK_R = 16
BLOCK_B = 256  # code bytes (512 elements) per program row


@triton.jit
def _e2m1_value(code):
    """fp32 value of E2M1 codes (int32 0..15)."""
    i = code & 7
    normal = (((i >> 1) + 126) << 23 | (i & 1) << 22).to(tl.float32, bitcast=True)
    mag = tl.where(i < 2, i.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, 0.0 - mag, mag)  # 0 - x: code 8 gives +0, as the quantisers write it


@triton.jit
def _block_values_kernel(data_ptr, scale_ptr, vals_ptr, R, NB,
                         BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (rows < R)[:, None] & (b < NB)[None, :]
    off = rows.to(tl.int64)[:, None] * NB + b[None, :]
    byte = tl.load(data_ptr + off, mask=mask, other=0).to(tl.int32)
    soff = rows.to(tl.int64)[:, None] * (NB // 8) + (b // 8)[None, :]  # 8 code bytes (16 elements) per scale
    s = tl.load(scale_ptr + soff, mask=mask, other=0).to(tl.int32)
    e = s >> 3
    m = s & 7
    sf = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    sf = tl.where((s & 0x7F) == 0x7F, float("nan"), sf)  # E4M3's NaN: the quantisers' scale of a NaN block
    lo = (_e2m1_value(byte & 15) * sf).to(tl.float16)
    hi = (_e2m1_value(byte >> 4) * sf).to(tl.float16)
    word = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    tl.store(vals_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + off, word, mask=mask)


def block_values_triton(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp16 [R, C] block values of packed codes data uint8 [R, C/2] with 1x16 block scales e4m3 [R, C/16]."""
    if (data.dim() != 2 or data.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or scale.dim() != 2
            or data.shape[1] % 8 or tuple(scale.shape) != (data.shape[0], data.shape[1] // 8)):
        raise ValueError(f"block_values: codes uint8 [R, C/2] and 1x16 scales e4m3 [R, C/16] expected, got "
                         f"{data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}")
    ensure_interpreter_compat()
    rows, nb = data.shape
    vals = torch.empty(rows, 2 * nb, dtype=torch.float16, device=data.device)
    if vals.numel():
        grid = (cdiv(rows, BLOCK_R), cdiv(nb, BLOCK_B))
        launcher(_block_values_kernel)[grid](
            data.contiguous(), scale.contiguous().view(torch.uint8), vals, rows, nb, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B,
            num_warps=4)
    return vals
