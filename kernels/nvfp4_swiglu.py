"""SwiGLU for the MoE experts, with NVFP4 quantisation of its output fused in (the FC2 input), plus its backward.

Forward: h = [gate | up] (FC1 output, bf16 [T, 2F]); a = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + e^-g) in
fp32: the two bf16 roundings mirror `F.silu(g) * u` on bf16 tensors (values agree with torch to rounding of the exp;
the learner and the rollout both call this kernel, so they agree bitwise with each other). The fused variant writes
a (bf16, kept for FC2's wgrad) and quantises it in the same pass: 1x16 blocks, one global scale per row (the
activation recipe), nearest-even, with minite.kernels.nvfp4_quant's tile arithmetic, so its codes are bitwise equal
to quantize_reference(a). One read of h replaces SwiGLU's read + write and the quantiser's second read of a.

Backward: dgate = da * up * s * (1 + g (1 - s)), dup = da * silu(g), s = sigmoid(g), fp32, one bf16 rounding each.
All kernels are elementwise or per-row: batch invariant by construction.

The experts' SwiGLU as the model computes it (`minite.ops.experts.swiglu`, default mode: fp32 silu(g) * u * prob,
rounded once to bf16), quantised for FC2 in the same pass (`expert_swiglu_quantize_triton`, forward only: the
rollout's decode step): torch's CUDA silu is x / (1 + expf(-x)) with IEEE division, here `div_rn` and libdevice's
expf (the CUDA math library's expf, which nvcc compiles torch's kernel with), so `a` has torch's bits on the GPU
(tests/kernels/test_swiglu.py, marker gpu); a is not stored (FC2's forward reads only its quantisation), and the
NaN/Inf flag of the NVFP4 layers (`finite_max`) takes max |a| in the same pass: eight launches of a decode step's
MoE layer (six elementwise, the flag's, the quantiser's) become one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minite.nvfp4.tensor import NVFP4Tensor

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher, next_power_of_2
from .finite_max import _max_into_flag
from .nvfp4_gemm import _load_f32
from .nvfp4_quant import (SIXTH, _block_amax, _decode_amax, _global_scales, _group_halves, _load_groups,
                          _nan_max, _quantize_tile, _round_to_input)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest-even bf16 value, still in fp32: nvfp4_quant's rounding to a bf16 input (on the GPU the
    hardware's convert, so a NaN stays NaN; the integer rounding's carry turned the GPU's NaN 0x7FFFFFFF into -0)."""
    return _round_to_input(x, tl.bfloat16)


@triton.jit
def _tile_offsets(rows, R, F, G: tl.constexpr):
    """(col, mask, base) of a [BLOCK_R, G, 8, 2] tile over columns 0..16G of h = [gate | up] [R, 2F]: the output
    column, which lanes hold one, and the gate's offset in h (the up value sits F further)."""
    g = tl.arange(0, G)
    jj = tl.arange(0, 8)
    pp = tl.arange(0, 2)
    col = g[None, :, None, None] * 16 + jj[None, None, :, None] * 2 + pp[None, None, None, :]
    mask = (rows < R)[:, None, None, None] & (col < F)
    return col, mask, rows[:, None, None, None].to(tl.int64) * (2 * F) + col


@triton.jit
def _quantize_rows(x, rows, R, F, sixth, data_ptr, scale_ptr, gs_ptr, amax_ptr, vals_ptr, BLOCK_R: tl.constexpr,
                   G: tl.constexpr, WRITE_VALS: tl.constexpr):
    """The activation recipe on a [BLOCK_R, G, 8, 2] tile of whole rows: per-row global scales (and the amaxes the
    tensor carries), 1x16 blocks, nearest-even."""
    bamax = _block_amax(x)
    amax = _nan_max(bamax, 1)
    s_enc, s_dec = _global_scales(amax)
    tl.store(gs_ptr + rows, s_dec, mask=rows < R)
    tl.store(amax_ptr + rows, _decode_amax(amax, s_enc), mask=rows < R)
    _quantize_tile(x, bamax, rows, 0, R, F, s_enc[:, None], s_dec[:, None], sixth, 0,
                   data_ptr, scale_ptr, vals_ptr, 0, 0, 0, F, BLOCK_R, G, 1, False, WRITE_VALS, False)


@triton.jit
def _swiglu_tile(h_ptr, a_ptr, rows, R, F, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """a = bf16(bf16(silu(g)) * u) as fp32 [BLOCK_R, G, 8, 2] for columns 0..16G of the F outputs; stores a. Loaded
    and stored as the two halves of each group (`_load_groups`: a thread holds whole groups; sm_90, Triton 3.6: 54
    instructions per element against 60 in the [BLOCK_R, G, 8, 2] addressing that `_tile_offsets` gives the
    experts' kernel below, where this form counted more: tools/bench/sass_census.py --quant)."""
    col = tl.arange(0, G)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]  # a group's first half
    mask = (rows < R)[:, None, None] & (col < F)  # the second half's too (F % 16 == 0)
    base = rows[:, None, None].to(tl.int64) * (2 * F) + col
    gate = _load_groups(h_ptr + base, h_ptr + base + 8, mask, mask, BLOCK_R, G)
    up = _load_groups(h_ptr + base + F, h_ptr + base + F + 8, mask, mask, BLOCK_R, G)
    silu = _round_bf16(gate / (1.0 + tl.exp(-gate)))
    a = _round_bf16(silu * up)
    a_lo, a_hi = _group_halves(a.to(tl.bfloat16), BLOCK_R, G, 8)
    aptr = a_ptr + rows[:, None, None].to(tl.int64) * F + col
    tl.store(aptr, a_lo, mask=mask)
    tl.store(aptr + 8, a_hi, mask=mask)
    return a


@triton.jit
def _swiglu_quant_kernel(h_ptr, a_ptr, data_ptr, scale_ptr, gs_ptr, amax_ptr, vals_ptr, R, F, sixth,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, QUANT: tl.constexpr,
                         WRITE_VALS: tl.constexpr):
    G: tl.constexpr = BLOCK_C // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    x = _swiglu_tile(h_ptr, a_ptr, rows, R, F, BLOCK_R, G)
    if QUANT:
        _quantize_rows(x, rows, R, F, sixth, data_ptr, scale_ptr, gs_ptr, amax_ptr, vals_ptr, BLOCK_R, G, WRITE_VALS)


@triton.jit
def _silu_libdevice(g):
    """torch's CUDA silu on fp32: g / (1 + expf(-g)), IEEE division, the CUDA math library's expf."""
    return tl.div_rn(g, 1.0 + libdevice.exp(-g))


@triton.jit
def _silu_interpreted(g):
    """The same under the interpreter, which has no libdevice: its tl.exp is numpy's (the CPU tests' reference)."""
    return tl.div_rn(g, 1.0 + tl.exp(-g))


@triton.jit
def _expert_swiglu_quant_kernel(h_ptr, p_ptr, data_ptr, scale_ptr, gs_ptr, amax_ptr, vals_ptr, flag_ptr, R, F, sixth,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WRITE_VALS: tl.constexpr,
                                FLAG: tl.constexpr, SILU: tl.constexpr):
    G: tl.constexpr = BLOCK_C // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    _, mask, base = _tile_offsets(rows, R, F, G)
    gate = _load_f32(h_ptr, base, mask)  # bf16 by its bits: exact under the interpreter too
    up = _load_f32(h_ptr, base + F, mask)
    prob = tl.load(p_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)
    silu = SILU(gate)
    r = silu * up * prob[:, None, None, None]  # (silu * u) * p in fp32, then one rounding to bf16, as torch
    x = _round_bf16(r)
    if FLAG:  # the NaN/Inf flag: max |a|, a NaN as +Inf
        _max_into_flag(flag_ptr, tl.reshape(tl.abs(x), [BLOCK_R * BLOCK_C]))
    _quantize_rows(x, rows, R, F, sixth, data_ptr, scale_ptr, gs_ptr, amax_ptr, vals_ptr, BLOCK_R, G, WRITE_VALS)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, R, F, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    base = rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
    gate = tl.load(h_ptr + base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + base + F, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sg = 1.0 / (1.0 + tl.exp(-gate))
    dgate = da * up * sg * (1.0 + gate * (1.0 - sg))
    dup = da * gate * sg
    if dh_ptr.dtype.element_ty == tl.bfloat16:
        dgate = _round_bf16(dgate)
        dup = _round_bf16(dup)
    tl.store(dh_ptr + base, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + base + F, dup.to(dh_ptr.dtype.element_ty), mask=mask)


SWIGLU_WARPS = 2  # `swiglu_quant_triton`'s warps (tools/bench/sass_census.py compiles what it launches)


def _tile(f: int) -> tuple[int, int]:
    block_c = next_power_of_2(f)
    return max(1, 2048 // block_c), block_c


def swiglu_quant_triton(h: torch.Tensor, quantize: bool = True, values_dtype: torch.dtype | None = torch.float16):
    """(a bf16 [T, F], NVFP4Tensor of a or None, block values or None) from h = [gate | up] bf16 [T, 2F]."""
    ensure_interpreter_compat()
    rows, two_f = h.shape
    f = two_f // 2
    if f % 16 or not h.is_contiguous():
        raise ValueError(f"swiglu_quant needs a contiguous [T, 2F] input with F % 16 == 0, got {tuple(h.shape)}")
    a = torch.empty(rows, f, dtype=torch.bfloat16, device=h.device)
    out = _row_outputs(rows, f, h.device, values_dtype if quantize else None)
    block_r, block_c = _tile(f)
    launcher(_swiglu_quant_kernel)[(cdiv(rows, block_r),)](
        h, a, *out, rows, f, SIXTH, BLOCK_R=block_r, BLOCK_C=block_c, QUANT=quantize,
        WRITE_VALS=bool(quantize and values_dtype), num_warps=SWIGLU_WARPS)
    if not quantize:
        return a, None, None
    return a, _row_tensor(out, rows, f), (out[4] if values_dtype else None)


def _row_outputs(rows: int, f: int, dev: torch.device, values_dtype: torch.dtype | None):
    """(data, scale, global scale, amax, block values) for the row quantisation of an [rows, f] tensor; without
    values_dtype the values slot holds `data` (an unused kernel argument)."""
    data = torch.empty(rows, f // 2, dtype=torch.uint8, device=dev)
    vals = torch.empty(rows, f, dtype=values_dtype, device=dev) if values_dtype else data
    return (data, torch.empty(rows, f // 16, dtype=torch.uint8, device=dev),
            torch.empty(rows, dtype=torch.float32, device=dev), torch.empty(rows, dtype=torch.float32, device=dev),
            vals)


def _row_tensor(out, rows: int, f: int) -> NVFP4Tensor:
    data, scale, gs, amax, _ = out
    return NVFP4Tensor(data=data, scale=scale.view(torch.float8_e4m3fn), global_scale=gs, shape=(rows, f),
                       block=(1, 16), amax=amax)


def expert_swiglu_quantize_triton(h: torch.Tensor, probs: torch.Tensor, flag: torch.Tensor | None = None,
                                  values: bool = True, silu=None, fp_fusion: bool = True) -> NVFP4Tensor:
    """The FC2 operand of the experts: the activation recipe's quantisation (1x16 blocks, per-row global scales,
    nearest-even) of a = swiglu(h, probs) as `minite.ops.experts.swiglu` computes it in default mode, for h =
    [gate | up] bf16 [R, 2F] and probs [R]; with fp16 block values (`NVFP4Tensor.values`) when `values`. flag: the
    NaN/Inf flag tensor (fp32, one element) that max |a| goes into (NaN as +Inf), or None. silu: a @triton.jit
    function of the fp32 gate in place of torch's silu (strict mode's: `minite.strict.fused_swiglu`), compiled with
    FMA contraction as Triton does by default (torch's silu: the math library's expf as nvcc builds it, which the
    GPU test matched) or without it (fp_fusion=False: strict mode's polynomials, separate multiplies and adds; the
    quantisation's multiply-adds have exact products, so contraction changes none of its bits). Forward only."""
    ensure_interpreter_compat()
    rows, two_f = h.shape
    f = two_f // 2
    if (h.dtype != torch.bfloat16 or f % 16 or two_f % 2 or not h.is_contiguous() or probs.shape != (rows,)
            or probs.device != h.device):
        raise ValueError(f"expert_swiglu_quantize needs a contiguous bf16 h [R, 2F] (F % 16 == 0) and probs [R] on "
                         f"its device, got h {h.dtype} {tuple(h.shape)}, probs {tuple(probs.shape)}")
    if flag is not None and (flag.dtype != torch.float32 or flag.numel() != 1 or flag.device != h.device):
        raise ValueError("expert_swiglu_quantize: the flag must be one fp32 element on h's device")
    out = _row_outputs(rows, f, h.device, torch.float16 if values else None)
    # one row per program on 8 warps for a decode step's rows, two on 2 warps above (H200, F = 768: 5.1 against
    # ~7.4 us at 512 rows, 10.7 against 13.8 us at 2048; every shape the same bits: rows are independent)
    block_r, warps = (1, 8) if rows <= 1024 else (2, 2)
    if rows:
        launcher(_expert_swiglu_quant_kernel)[(cdiv(rows, block_r),)](
            h, probs.contiguous(), *out, flag if flag is not None else out[2], rows, f, SIXTH,
            BLOCK_R=block_r, BLOCK_C=next_power_of_2(f), WRITE_VALS=values, FLAG=flag is not None,
            SILU=silu or (_silu_interpreted if interpreting() else _silu_libdevice), num_warps=warps,
            enable_fp_fusion=fp_fusion)
    q = _row_tensor(out, rows, f)
    if values:
        q.values = out[4]
    return q


def swiglu_bwd_triton(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """d[gate | up] (bf16 [T, 2F]) from h = [gate | up] and da = dL/da."""
    ensure_interpreter_compat()
    rows, two_f = h.shape
    f = two_f // 2
    dh = torch.empty_like(h)
    block_r, block_c = 4, min(1024, next_power_of_2(f))
    launcher(_swiglu_bwd_kernel)[(cdiv(rows, block_r), cdiv(f, block_c))](
        h, da.contiguous(), dh, rows, f, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return dh


class SwiGLUFunction(torch.autograd.Function):
    """BF16 SwiGLU with the Triton forward and backward (used by the BF16 baseline in tools/bench)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return swiglu_quant_triton(h, quantize=False)[0]

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return swiglu_bwd_triton(h, da)
