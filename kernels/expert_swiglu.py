"""The experts' SwiGLU as the model computes it, forward and backward, for training in either precision.

`minite.ops.experts.swiglu` (default mode) is, in torch's ops,

    a = bf16(silu(g) * u * p)        g, u = fp32 halves of h = [gate | up] (bf16 [R, 2F]), p = the row's router prob

and autograd runs its backward as ~10 elementwise launches over fp32 [R, F] tensors, after a forward of ~6 that keeps
four of them for the backward (16 bytes per element of a, where h itself is 4). Here the forward is one launch that
keeps nothing (the backward recomputes from h), and the backward one launch:

    forward    a = bf16((silu(g) * u) * p)                     silu(g) = g / (1 + expf(-g)), IEEE division
    backward   t = da * p                                      (the mul's gradient towards silu(g) * u)
               dgate = bf16((t * u) * s * (1 + g * (1 - s)))   s = 1 / (1 + expf(-g)): torch's silu_backward
               dup = bf16(t * silu(g))
               dp = sum over the row of da * (silu(g) * u)      fp32: a sum per tile of 256 columns, then the tiles'
                                                               sums left to right (torch sums in its own order)

with da = the fp32 value of the bf16 gradient of a. Each line is the operation torch's kernels run, in their order
(torch's CUDA silu_backward: dy * s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x))); the GPU builds of both may contract
`1 + g * (1 - s)` into one fused multiply-add, so the kernels keep Triton's default contraction, and whether dh has
torch's bits on the GPU is what tests/kernels/test_expert_swiglu.py's GPU test checks. The row sum dp is a reduction
whose order torch does not fix: equal to torch's within rounding, not bitwise. Under the interpreter exp is numpy's,
so the CPU tests compare with these formulas in torch with numpy's exp.

The forward's bits are `expert_swiglu_quantize_triton`'s `a` (kernels/nvfp4_swiglu.py), which the rollout already
computes in its decode steps. Rows are independent: batch invariant.

The backward can also give max |dh| over the stored bf16 values (`amax=True`), the amax that FC1's dgrad operand
(dh, quantised at tensor scope) would otherwise take in a pass of its own over dh: each program's max of the bits it
stored, (bits & 0x7FFF) << 16 as int32 (the fp32 bits of |value|; for values >= 0 and NaN the integer order is the
float order, NaN above +inf, so a NaN anywhere gives a NaN amax), then one int max over the programs' partials.
Exact, in any order.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher, next_power_of_2
from .nvfp4_gemm import _load_f32
from .nvfp4_swiglu import _round_bf16

FORWARD_ELEMS = 2048  # outputs per program of the forward (rows x a power-of-two slice of the F columns)
BACKWARD_ELEMS = 2048  # elements per program of the backward (the row sum dp: a partial per column tile)


@triton.jit
def _exp_neg_libdevice(g):
    """expf(-g) as torch's CUDA kernels compute it (the CUDA math library's expf)."""
    return libdevice.exp(-g)


@triton.jit
def _exp_neg_interpreted(g):
    """The same under the interpreter, which has no libdevice: numpy's exp (the CPU tests' reference)."""
    return tl.exp(-g)


@triton.jit
def _store_bf16(ptr, offs, x, mask):
    """fp32 x stored as bf16 rounded to nearest even (`_round_bf16`: on the GPU cvt.rn.bf16.f32, whose NaN is the
    canonical one, as torch's CUDA cast; in the interpreter by the bits, its cast truncating and mangling subnormals).
    Returns the bits stored (uint16)."""
    bits = (_round_bf16(x).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, bits, mask=mask)
    return bits


@triton.jit
def _abs_bits_max(bits, mask):
    """max over a tile of the fp32 bits of |bf16 value| (int32; masked lanes +0) of stored bf16 bits (uint16)."""
    mag = tl.where(mask, bits.to(tl.int32) & 0x7FFF, 0)
    return tl.max(tl.max(mag, axis=1), axis=0) << 16  # the shift once: it keeps the order of the magnitudes


@triton.jit
def _forward_kernel(h_ptr, p_ptr, a_ptr, R, F, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXP_NEG: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    base = rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
    gate = _load_f32(h_ptr, base, mask)
    up = _load_f32(h_ptr, base + F, mask)
    prob = tl.load(p_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + EXP_NEG(gate))
    a = silu * up * prob[:, None]
    _store_bf16(a_ptr, rows[:, None].to(tl.int64) * F + cols[None, :], a, mask)


@triton.jit
def _backward_kernel(h_ptr, p_ptr, da_ptr, dh_ptr, dp_ptr, amax_ptr, R, F, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, EXP_NEG: tl.constexpr, AMAX: tl.constexpr):
    """dh, and dp's partial sum over this program's BLOCK_C columns (dp_ptr: fp32 [R, cdiv(F, BLOCK_C)]); AMAX: the
    program's max |dh| as fp32 bits into amax_ptr (int32, one per program, row-major over the grid)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    base = rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
    gate = _load_f32(h_ptr, base, mask)
    up = _load_f32(h_ptr, base + F, mask)
    da = _load_f32(da_ptr, rows[:, None].to(tl.int64) * F + cols[None, :], mask)
    prob = tl.load(p_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)
    e = EXP_NEG(gate)
    silu = tl.div_rn(gate, 1.0 + e)
    s = tl.div_rn(1.0, 1.0 + e)
    t = da * prob[:, None]
    dgate = (t * up) * s * (1.0 + gate * (1.0 - s))
    dup = t * silu
    dp = tl.sum(tl.where(mask, da * (silu * up), 0.0), axis=1)
    gate_bits = _store_bf16(dh_ptr, base, dgate, mask)
    up_bits = _store_bf16(dh_ptr, base + F, dup, mask)
    tl.store(dp_ptr + rows.to(tl.int64) * tl.num_programs(1) + tl.program_id(1), dp, mask=rows < R)
    if AMAX:
        m = tl.maximum(_abs_bits_max(gate_bits, mask), _abs_bits_max(up_bits, mask))
        tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), m)


def _check(h: torch.Tensor, probs: torch.Tensor) -> int:
    if (h.dim() != 2 or h.dtype != torch.bfloat16 or h.shape[1] % 2 or probs.shape != (h.shape[0],)
            or probs.device != h.device):
        raise ValueError(f"expert_swiglu needs h bf16 [R, 2F] and probs [R] on its device, got h {h.dtype} "
                         f"{tuple(h.shape)}, probs {tuple(probs.shape)} on {probs.device}")
    return h.shape[1] // 2


def tile(f: int, elems: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a launch over F columns: column tiles of up to 256 (F = 768: three, none masked), rows
    to `elems` elements a program."""
    block_c = min(next_power_of_2(f), 256)
    return max(1, elems // block_c), block_c


def _exp_neg():
    return _exp_neg_interpreted if interpreting() else _exp_neg_libdevice


def expert_swiglu_triton(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """a = bf16(silu(gate) * up * prob) (bf16 [R, F]) for h = [gate | up] bf16 [R, 2F] and probs [R] (module
    docstring)."""
    ensure_interpreter_compat()
    f = _check(h, probs)
    rows = h.shape[0]
    a = torch.empty(rows, f, dtype=torch.bfloat16, device=h.device)
    if rows and f:
        h = h.contiguous()
        block_r, block_c = tile(f, FORWARD_ELEMS)
        launcher(_forward_kernel)[(cdiv(rows, block_r), cdiv(f, block_c))](
            h, probs.contiguous(), a, rows, f, BLOCK_R=block_r, BLOCK_C=block_c, EXP_NEG=_exp_neg(), num_warps=4)
    return a


def expert_swiglu_backward_triton(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor, *, amax: bool = False):
    """(dh bf16 [R, 2F], dprobs fp32 [R]) of `expert_swiglu_triton` for the gradient da (bf16 [R, F]) of its output
    (module docstring); amax: also max |dh| (fp32, 0-d, on dh's device; +0 for an empty dh), as a third element."""
    ensure_interpreter_compat()
    f = _check(h, probs)
    rows = h.shape[0]
    if da.shape != (rows, f) or da.device != h.device:
        raise ValueError(f"expert_swiglu backward: da of shape {tuple(da.shape)} on {da.device}, expected "
                         f"{(rows, f)} on {h.device}")
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    if not (rows and f):
        dp = torch.zeros(rows, dtype=torch.float32, device=h.device)
        return (dh, dp, torch.zeros((), dtype=torch.float32, device=h.device)) if amax else (dh, dp)
    block_r, block_c = tile(f, BACKWARD_ELEMS)
    grid = (cdiv(rows, block_r), cdiv(f, block_c))
    parts = torch.empty(rows, grid[1], dtype=torch.float32, device=h.device)
    maxima = torch.empty(grid[0] * grid[1] if amax else 1, dtype=torch.int32, device=h.device)
    launcher(_backward_kernel)[grid](
        h.contiguous(), probs.contiguous(), da.contiguous(), dh, parts, maxima, rows, f, BLOCK_R=block_r,
        BLOCK_C=block_c, EXP_NEG=_exp_neg(), AMAX=amax, num_warps=4)
    # the column tiles' partial sums added left to right (one tile: the sum itself): dprobs' order, fixed for a
    # given F whatever the rows (one add launch per tile after the first)
    dp = parts[:, 0].clone() if grid[1] == 1 else functools.reduce(torch.add, parts.unbind(1))
    if amax:  # the programs' maxima: one exact int max, no host read
        return dh, dp, maxima.amax().view(torch.float32)
    return dh, dp
