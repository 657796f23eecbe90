"""The optimizer's fp32 master -> bf16 weight copy of a stack of expert weights, with each expert's amax in the same
pass (issue 17: the NVFP4 re-quantisation's first read fused into the optimizer step).

After its update Megatron's optimizer writes every bf16 weight from its fp32 master (`that.copy_(this)`), and the
next forward quantises the expert weights [E, N, K], each expert with its own global scale from its amax
max |W_e|: a full extra read of every expert weight (`minite.nvfp4.grouped.stack_amax`, 1.2-1.7 ms of a
113-127 ms step on the H200). This kernel does the copy and takes the max while the bf16 values are in registers:
    weight[e, i] = bf16(master[e, i])          round to nearest even, as torch's copy_
    amax[e]      = max_i |weight[e, i]|        fp32 [E], the max of the *bf16* values (what stack_amax reads)
Each program copies a run of one expert's elements and adds its max to amax[e] with one atomic max on the fp32
bits as int32: the magnitudes are >= 0, where the float order is the integer order of the bits, so the result is
the exact max whatever order the programs run in (a -0 counts as +0: the magnitude drops the sign bit, as the
abs in stack_amax does). The magnitude is taken from the bf16 bits themselves (sign bit cleared, shifted to fp32),
so it is the value stored, exactly.

Rounding: on the GPU the hardware's fp32 -> bf16 conversion (cvt.rn.bf16.f32, the instruction torch's CUDA copy
uses). Triton's CPU interpreter casts by truncating the mantissa, so there the rounding is integer arithmetic on
the bits (as kernels/nvfp4_quant.py `_round_to_input`): add 0x7FFF plus the lowest kept bit, drop 16 bits; exact
round-to-nearest-even for every finite value (bf16 has fp32's exponent range, so subnormals round the same way, and
values past bf16's largest finite value round to +-Inf), and Inf stays Inf.
NaN: the weight gets a NaN and amax[e] a NaN (the largest magnitude bits, above Inf's), as stack_amax returns a NaN
for an expert holding one; which NaN bits is not specified (torch's CPU copy writes 0x7FC0 or 0xFFFF depending on
its vector path; here the interpreter writes 0x7FC0 and the GPU what its conversion gives).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher

BLOCK = 4096
"""Elements per load of a program."""
ITERS = 8
"""Loads per program: each program copies BLOCK * ITERS elements of one expert, then one atomic max."""


@triton.jit
def _copy_amax_kernel(src_ptr, dst_ptr, n_per, amax_bits_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                      INT_RNE: tl.constexpr):
    """Program (c, e): elements [c * BLOCK * ITERS, (c + 1) * BLOCK * ITERS) of expert e (n_per elements each) from
    the fp32 src to the bf16 dst (written as int16 bits), and max |bf16| into amax_bits_ptr[e] (fp32 bits, int32)."""
    e = tl.program_id(1)
    base = e.to(tl.int64) * n_per
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    m = tl.zeros([BLOCK], tl.int32)  # the bits of +0.0
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_per
        x = tl.load(src_ptr + base + offs, mask=mask, other=0.0)
        if INT_RNE:  # the interpreter: round to nearest even on the bits (its float cast truncates)
            bits = x.to(tl.int32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # the low 16 bits are the bf16 bits
            h = tl.where(x == x, r, 0x7FC0).to(tl.int16)
        else:
            h = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
        tl.store(dst_ptr + base + offs, h, mask=mask)
        m = tl.maximum(m, (h.to(tl.int32) & 0x7FFF) << 16)  # |bf16| as fp32 bits (masked lanes: 0)
    tl.atomic_max(amax_bits_ptr + e, tl.max(m, axis=0))


def copy_amax_triton(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst <- bf16(src) (bitwise torch's dst.copy_(src) for finite values and Inf) for an fp32 src and a bf16 dst of
    one shape [E, ...], both contiguous on one device; returns max |dst[e]| per expert, fp32 [E] (bitwise
    minite.nvfp4.grouped.stack_amax(dst)). One launch plus the zeroing of the [E] result; no host synchronisation.
    Writes dst's storage directly (its version counter is not bumped, as with a copy through `.data`)."""
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or src.shape != dst.shape or src.dim() < 1:
        raise ValueError(f"copy_amax: needs an fp32 source and a bf16 destination of one shape [E, ...], got "
                         f"{src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)}")
    if src.device != dst.device or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_amax: source and destination must be contiguous and on one device")
    ensure_interpreter_compat()
    e = src.shape[0]
    bits = torch.zeros(e, dtype=torch.int32, device=src.device)
    n_per = src.numel() // e if e else 0
    if n_per:
        grid = (cdiv(n_per, BLOCK * ITERS), e)
        launcher(_copy_amax_kernel)[grid](src, dst.view(torch.int16), n_per, bits, BLOCK=BLOCK, ITERS=ITERS,
                                          INT_RNE=interpreting(), num_warps=8)
    return bits.view(torch.float32)
