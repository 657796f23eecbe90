"""Fused NVFP4 quantisation in Triton, bitwise equal to minite.nvfp4.quantize_reference.

One program owns BLOCK_R rows x BLOCK_C columns (a whole row when the global scale is per row) and does, in fp32 and
in Transformer Engine's order (docs/nvfp4.md, "Quantisation"; the reference module docstring has the formula):
    [RHT]  y_j = ((s_0j x_0 + s_1j x_1) + ... + s_15j x_15) * 1/4 per 16-group, left to right (s_ij = +-1, exact),
           rounded to the input dtype when it is bf16/fp16 (minite.nvfp4.hadamard; docs/nvfp4.md, "RHT")
    amax   per row (scale_scope="row", inside the same program) or per tensor (a first reduction pass)
    S_enc = min(2688 / amax, FLT_MAX) (1 when amax is 0), S_dec = 1 / S_enc          (IEEE division: tl.div_rn)
    block scale = e4m3_rne(min(block_amax * (S_enc * (1/6)), 448))                     (integer bit arithmetic)
    multiplier  = min(1 / (float(scale) * S_dec), FLT_MAX)
    code        = e2m1(clamp(x * multiplier, -6, 6))  nearest-even, or stochastic from the uint32 counter hash
and writes packed codes (even element in the low nibble), E4M3 scale bytes, the per-row decode scales and, on
request, the block values (code x block scale, exact in fp16/bf16) that feed an MMA directly.

The E4M3 and E2M1 roundings are kernels/nvfp4_encode.py's (exact on the GPU and in the interpreter: integer bit
arithmetic, and on the GPU the E2M1 encoding of a pair, nearest-even or stochastic, as one PTX block on fp32 adds and
integer multiply-adds: `_pair_ptx`). Instructions per element (sm_90 SASS, Triton 3.6; tools/bench/sass_census.py
--quant, at the launchers' tiles) went from 50 to 34.8 (per-row, codes + values), 100 to 67.5 (stochastic) and 106 to
90 (a wgrad segment of dy^T, RHT + stochastic) in earlier sessions; with the PTX encodings they are 25.6 (per-row,
codes + values, and whole groups a thread: `_group_view`), 43.8 (tensor scope, stochastic, values, the same) and
69.8 (the wgrad segment) on Triton 3.6 (2026-12-04); on the H200 the quantisers turned out bound by the integer ALU pipe
rather than by instruction issue (ncu, 2026-12-04), which the PTX encoding addresses. docs/benchmarks.md has the
times.

Tile layout: [BLOCK_R, G, 8, 2] (rows, 16-groups, byte, nibble), so block maxima reduce the last two axes and the
nibble pair of a byte is a split of the last axis: no reshape moves data between threads. Row-major tiles are loaded
as two halves of each group and joined into that view (`_group_view`), so that one thread holds a whole group.

Memory passes: scale_scope="row" with rows of at most 8192 elements is one pass (read x once, write 0.5625 B/elem,
plus 2 B/elem if block values are requested). scale_scope="tensor" needs the amax of the whole tensor first: one
extra read pass (`_amax_kernel`, a few programs per SM, each looping over tiles), then the quantisation pass.

NaN (an input the GPU path does not check: check_finite is off there): the amaxes are NaN-propagating maxima
(`_nan_max`: max.NaN.f32, one instruction as tl.max's max.f32, which drops a NaN), so a NaN anywhere in the scope
gives a NaN amax and global scale, as the reference's torch amax. A block whose scale is NaN (a NaN in the block, or
a NaN global scale) gets E4M3's NaN code 0x7F, NaN block values and a multiplier of 0, so its codes are 0 as the
reference's (whose multiplier is NaN and whose comparisons of NaN give code 0), except for the elements that are
NaN or +-Inf themselves (with the RHT: every element of their 16-group), code 7 here (E2M1 min(|v|, 6) drops the NaN
of v = x * 0): they decode to NaN either way, through the NaN scale. NaN bit patterns (payload, sign) are not
specified: the GPU writes its canonical NaN.

Batch invariance: with scale_scope="row", a row's codes, scales and decode scale depend on that row alone (the
amax is a max, exact in any order), so a token quantises identically at M=1 and inside any batch.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from minite.nvfp4.hadamard import RHT_SIGNS
from minite.nvfp4.quantize import SATURATED_AMAX
from minite.nvfp4.tensor import NVFP4Tensor

from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher, next_power_of_2, sm_count
from .finite_max import _max_into_flag
from .nvfp4_encode import _PTX, _e4m3_rne, _encode_pairs, _values_word
from .nvfp4_seeds import _as_int32_bits, seed_mix  # noqa: F401 (seed_mix: part of this module's API)

FP32_MAX = float(np.finfo(np.float32).max)
SIXTH = float(np.float32(1.0) / np.float32(6.0))  # the reference's fp32 1/6, exactly representable as a Python float
# bit i set when sign i of the RHT sign vector is -1
RHT_SIGN_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)
MAX_SINGLE_PASS_COLS = 8192
_SATURATED_AMAX = tl.constexpr(SATURATED_AMAX)  # an fp32 value, exact as a Python float


@triton.jit
def _round_to_input(y, in_ty: tl.constexpr):
    """fp32 y rounded to nearest even in the input dtype (bf16 / fp16) and back to fp32, as Transformer Engine rounds
    its RHT output; fp32 inputs unchanged. bf16: on the GPU the hardware's convert (cvt.rn.bf16x2.f32: a NaN stays
    NaN, where the integer rounding's carry turns the GPU's NaN 0x7FFFFFFF into -0; sm_90, Triton 3.6: 1.5 fewer
    instructions per element, and the amax pass takes its max in bf16 pairs), in the interpreter integer arithmetic
    (its fp32 -> bf16 cast truncates; exact for finite values, and a NaN from a bf16 input keeps a NaN, its low 16
    bits being 0); fp16 with the cast (RNE in the interpreter and on the GPU)."""
    if in_ty == tl.bfloat16 and _PTX:
        return y.to(tl.bfloat16).to(tl.float32)
    elif in_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif in_ty == tl.float16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, rows, c0, R, C,
               BLOCK_R: tl.constexpr, G: tl.constexpr, RHT: tl.constexpr, SIGN_MASK: tl.constexpr,
               VEC2D: tl.constexpr, PARTIAL: tl.constexpr = False):
    """fp32 tile [BLOCK_R, G, 8, 2] of x: rows `rows`, 16-groups g at columns c0 + 16 g + 2 j + p; Hadamard-
    transformed per 16-group when RHT. The 4-D shape (group, pair, even/odd) is the layout every later step needs
    (block reductions over the last two axes, nibble packing over the last one), so no reshape moves data.
    Columns at or past C read as zeros; PARTIAL: C need not be a multiple of 16 (element masks, not group masks:
    the zero padding of a segment that the kernel pads itself)."""
    rmask = rows < R
    gcol = c0 + tl.arange(0, G) * 16
    if RHT:
        r4 = rows[:, None, None, None].to(tl.int64) * stride_r
        g4 = gcol[None, :, None, None].to(tl.int64) * stride_c
        m4 = rmask[:, None, None, None] & (gcol < C)[None, :, None, None]
        j16 = tl.arange(0, 8)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [8, 2]: position within the 16-group
        # y_j = (s_0j x_0 + s_1j x_1 + ...) * 1/4 in this order; s_ij = sign_i * (-1)^popcount(i & j) = +-1, so each
        # product is an exact sign flip (subnormal inputs included) and fma contraction cannot change the sum
        x0 = tl.load(x_ptr + r4 + g4, mask=m4, other=0.0).to(tl.float32)
        p0 = 0 & j16
        par0 = (p0 ^ (p0 >> 1) ^ (p0 >> 2) ^ (p0 >> 3)) & 1
        mv0 = tl.where(par0 == 1, -1.0, 1.0) * (1.0 - 2.0 * ((SIGN_MASK >> 0) & 1))
        acc = x0 * mv0[None, None, :, :]
        for i in tl.static_range(1, 16):
            mi = (m4 & (gcol + i < C)[None, :, None, None]) if PARTIAL else m4
            xi = tl.load(x_ptr + r4 + g4 + i * stride_c, mask=mi, other=0.0).to(tl.float32)
            pi = i & j16
            par = (pi ^ (pi >> 1) ^ (pi >> 2) ^ (pi >> 3)) & 1
            mvi = tl.where(par == 1, -1.0, 1.0) * (1.0 - 2.0 * ((SIGN_MASK >> i) & 1))
            acc = acc + xi * mvi[None, None, :, :]
        return _round_to_input(acc * 0.25, x_ptr.dtype.element_ty)
    elif VEC2D:
        # a 2-D load (16-byte vectors along the row), reshaped: the 4-D view needs no data movement
        cols = c0 + tl.arange(0, G * 16)
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        x2 = tl.load(ptrs, mask=rmask[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
        return tl.reshape(x2, [BLOCK_R, G, 8, 2])
    else:  # each group as two halves of 8 elements (`_group_view`)
        r3 = rows[:, None, None].to(tl.int64) * stride_r
        m3 = rmask[:, None, None] & (gcol < C)[None, :, None]
        c3 = gcol[None, :, None] + tl.arange(0, 8)[None, None, :]
        return _load_groups(x_ptr + r3 + c3.to(tl.int64) * stride_c, x_ptr + r3 + (c3 + 8).to(tl.int64) * stride_c,
                            (m3 & (c3 < C)) if PARTIAL else m3, (m3 & (c3 + 8 < C)) if PARTIAL else m3, BLOCK_R, G)


@triton.jit
def _load_groups(lo_ptrs, hi_ptrs, lo_mask, hi_mask, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """fp32 [BLOCK_R, G, 8, 2] tile of two [BLOCK_R, G, 8] loads, each group's first and second 8 elements (masked
    lanes read 0), joined by `_group_view`."""
    return _group_view(tl.load(lo_ptrs, mask=lo_mask, other=0.0).to(tl.float32),
                       tl.load(hi_ptrs, mask=hi_mask, other=0.0).to(tl.float32), BLOCK_R, G)


@triton.jit
def _group_view(lo, hi, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """The [BLOCK_R, G, 8, 2] tile (group, pair, even/odd) of two [BLOCK_R, G, 8] tiles, a group's first and second
    8 elements: a join, a permute and a reshape of the elements a thread holds (no data movement in the quantisers'
    compiled layouts, sm_90 census). Row-major tiles are
    loaded as these halves (a 16-byte load each in bf16), so that a thread holds whole groups and a group's maximum
    and scale are one thread's work, on Triton 3.6 and 3.9 alike. Loaded as [BLOCK_R, G, 8, 2], the axis that gets
    the threads first depends on how a Triton version orders axes of equal contiguity: 3.9 gave a group's 8 pairs
    to 8 threads, each computing the group's scale (twice the instructions per element; sm_90,
    tools/bench/sass_census.py --quant; docs/benchmarks.md, issue 17 in the twenty-third session)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), [BLOCK_R, G, 8, 2])


@triton.jit
def _group_halves(t, BLOCK_R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """The inverse of `_group_view`: the first and the second W items of each group of a [BLOCK_R, G, ...] tile of
    2 W items a group ([BLOCK_R, G, 8, 2] elements: W = 8; [BLOCK_R, G, 8] words of pairs: W = 4), [BLOCK_R, G, W]
    each, to store as the halves were loaded."""
    return tl.split(tl.permute(tl.reshape(t, [BLOCK_R, G, 2, W]), (0, 1, 3, 2)))


@triton.jit
def _nan_max_combine(a, b):
    """max(a, b), NaN when either is NaN: PTX max.NaN.f32, one instruction as max.f32 (sm_80+). tl.max combines with
    max.f32 (maxnumf), which drops a NaN: one NaN among finite values would vanish from an amax."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


_nan_max_combine.numpy_reduce = np.max  # the interpreter's fast path (ensure_interpreter_compat): the same values


@triton.jit
def _nan_max(x, axis: tl.constexpr):
    """The max of fp32 x along axis, NaN where any element is NaN, as torch's amax (exact in any order: a max)."""
    return tl.reduce(x, axis, _nan_max_combine)


@triton.jit
def _block_amax(x):
    """max |x| of each 16-group of a [BLOCK_R, G, 8, 2] tile: [BLOCK_R, G] (exact in any order; NaN if one is)."""
    return _nan_max(_nan_max(tl.abs(x), 3), 2)


@triton.jit
def _row_amax(x):
    """max |x| over the last three axes of a [BLOCK_R, G, 8, 2] tile (exact in any order; NaN if one is)."""
    return _nan_max(_block_amax(x), 1)


@triton.jit
def _global_scales(amax):
    """(S_enc, S_dec) from amax, as global_encode_scale and 1 / S_enc in the reference (fp32, IEEE division; a NaN
    amax gives NaN scales, as torch.clamp does: the GPU's plain min.f32 would return FLT_MAX)."""
    s = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), 3.4028234663852886e38,
                   propagate_nan=tl.PropagateNan.ALL)
    s = tl.where((amax == 0.0) | (s == 0.0), 1.0, s)
    return s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _decode_amax(amax, s_enc):
    """The amax the tensor carries (minite.nvfp4.quantize.decode_amax): SATURATED_AMAX where S_enc = FLT_MAX."""
    return tl.where(s_enc == 3.4028234663852886e38, _SATURATED_AMAX, amax)


@triton.jit
def _quantize_tile(x, bamax, rows, c0, R, C, s_enc, s_dec, sixth, seed_mix,
                   data_ptr, scale_ptr, vals_ptr, scale_row0, out_r0, out_c0, OC,
                   BLOCK_R: tl.constexpr, G: tl.constexpr, BR: tl.constexpr,
                   STOCHASTIC: tl.constexpr, WRITE_VALS: tl.constexpr, VEC2D: tl.constexpr):
    """Quantise a [BLOCK_R, G, 8, 2] fp32 tile with block maxima bamax = _block_amax(x) (the caller's: a per-row
    amax reduces the same maxima); s_enc/s_dec are scalars or [BLOCK_R, 1] (per row).

    rows, c0, R, C are coordinates inside the tensor being quantised (masks, the stochastic-rounding index); the
    outputs land at row out_r0 + r, column out_c0 + c of output arrays OC columns wide (0, 0, C for a whole tensor;
    a segment of a larger tensor otherwise, out_c0 a multiple of 16)."""
    rmask = rows < R
    g = tl.arange(0, G)
    jj = tl.arange(0, 8)
    gmask = (c0 + g * 16) < C
    if BR == 16:
        bamax = _nan_max(bamax, 0)[None, :]  # one amax per 16x16 tile
    # a NaN block amax or global scale (a NaN in x: check_finite is off on the GPU) gives a NaN scale, E4M3's NaN code
    # and a multiplier of 0 where the reference's is NaN (codes 0 but where x is NaN or +-Inf; module docstring)
    sv = tl.minimum(bamax * (s_enc * sixth), 448.0, propagate_nan=tl.PropagateNan.ALL)
    scode, sf = _e4m3_rne(sv)
    mult = tl.clamp(tl.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * s_dec), 0.0, 3.4028234663852886e38)
    v = x * mult[:, :, None, None]
    byte, re, ro = _encode_pairs(v, rows, c0, C, seed_mix, G, STOCHASTIC, WRITE_VALS)
    orows = (out_r0 + rows).to(tl.int64)
    if VEC2D:
        bcols = c0 // 2 + tl.arange(0, G * 8)
        doff = orows[:, None] * (OC // 2) + out_c0 // 2 + bcols[None, :]
        tl.store(data_ptr + doff, tl.reshape(byte, [BLOCK_R, G * 8]), mask=rmask[:, None] & (bcols < C // 2)[None, :])
    else:
        bcol = (c0 // 2 + g * 8)[None, :, None] + jj[None, None, :]
        doff = orows[:, None, None] * (OC // 2) + out_c0 // 2 + bcol
        tl.store(data_ptr + doff, byte, mask=rmask[:, None, None] & gmask[None, :, None])
    scols = c0 // 16 + g
    if BR == 16:
        sptr = scale_ptr + (out_r0 // 16 + scale_row0).to(tl.int64) * (OC // 16) + out_c0 // 16 + scols
        tl.store(sptr, tl.reshape(scode, [G]).to(tl.uint8), mask=gmask)
    else:
        sptr = scale_ptr + orows[:, None] * (OC // 16) + out_c0 // 16 + scols[None, :]
        tl.store(sptr, scode.to(tl.uint8), mask=rmask[:, None] & gmask[None, :])
    if WRITE_VALS:
        # the block values in pairs: one 32-bit word per code byte (even element in the low half), stored with the
        # codes' addressing, so the stores vectorise as the codes' do (one 16-bit store per element otherwise)
        word = _values_word(re * sf[:, :, None], ro * sf[:, :, None], vals_ptr.dtype.element_ty)
        wptr = tl.multiple_of(vals_ptr.to(tl.pointer_type(tl.uint32), bitcast=True), 16)
        if VEC2D:
            tl.store(wptr + doff, tl.reshape(word, [BLOCK_R, G * 8]),
                     mask=rmask[:, None] & (bcols < C // 2)[None, :])
        else:
            # stored as two [BLOCK_R, G, 4] halves (16 bytes each), as `_group_view` loads: a thread's words stay
            # in that thread (stored as [BLOCK_R, G, 8], the compiler splits a group's 32 bytes over two threads)
            wlo, whi = _group_halves(word, BLOCK_R, G, 4)
            woff = (orows[:, None, None] * (OC // 2) + out_c0 // 2 + (c0 // 2 + g * 8)[None, :, None]
                    + tl.arange(0, 4)[None, None, :])
            wmask = rmask[:, None, None] & gmask[None, :, None]
            tl.store(wptr + woff, wlo, mask=wmask)
            tl.store(wptr + woff + 4, whi, mask=wmask)


@triton.jit(do_not_specialize=["seed_mix"])
def _quant_kernel(x_ptr, stride_r, stride_c, R, C, data_ptr, scale_ptr, gs_ptr, vals_ptr,
                  seed_mix, sixth, amax_ptr, amax_out_ptr, flag_ptr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BR: tl.constexpr, ROW_SCOPE: tl.constexpr,
                  SINGLE: tl.constexpr, STOCHASTIC: tl.constexpr, RHT: tl.constexpr, WRITE_VALS: tl.constexpr,
                  SIGN_MASK: tl.constexpr, VEC2D: tl.constexpr, GIVEN_AMAX: tl.constexpr = False,
                  FLAG: tl.constexpr = False):
    """Per-row scales (ROW_SCOPE): each row's amax from the row itself, or with GIVEN_AMAX read from amax_ptr (the
    caller's, e.g. all-reduced over a tensor-parallel group). Per-tensor scale: amax_ptr holds the tensor's amax.
    FLAG: *flag_ptr = max(*flag_ptr, max |x| of the program's tiles), NaN as +Inf (the NaN/Inf flag, `_max_into_flag`),
    from the block maxima the quantisation takes anyway."""
    G: tl.constexpr = BLOCK_C // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    scale_row0 = pid_r  # 16x16 blocks: BLOCK_R == 16, one scale row per program
    if ROW_SCOPE:
        if SINGLE:
            x = _load_tile(x_ptr, stride_r, stride_c, rows, 0, R, C, BLOCK_R, G, RHT, SIGN_MASK, VEC2D)
            bamax = _block_amax(x)
            row_max = _nan_max(bamax, 1)
            if FLAG:
                _max_into_flag(flag_ptr, row_max)
            if GIVEN_AMAX:
                amax = tl.load(amax_ptr + rows, mask=rows < R, other=0.0)
            else:
                amax = row_max
            s_enc, s_dec = _global_scales(amax)
            tl.store(gs_ptr + rows, s_dec, mask=rows < R)
            tl.store(amax_out_ptr + rows, _decode_amax(amax, s_enc), mask=rows < R)
            _quantize_tile(x, bamax, rows, 0, R, C, s_enc[:, None], s_dec[:, None], sixth, seed_mix,
                           data_ptr, scale_ptr, vals_ptr, scale_row0, 0, 0, C, BLOCK_R, G, BR, STOCHASTIC, WRITE_VALS,
                           VEC2D)
        else:
            if GIVEN_AMAX:
                amax = tl.load(amax_ptr + rows, mask=rows < R, other=0.0)
            else:
                amax = tl.zeros([BLOCK_R], tl.float32)
                for c0 in range(0, C, BLOCK_C):
                    x = _load_tile(x_ptr, stride_r, stride_c, rows, c0, R, C, BLOCK_R, G, RHT, SIGN_MASK, VEC2D)
                    amax = tl.maximum(amax, _row_amax(x), propagate_nan=tl.PropagateNan.ALL)
            s_enc, s_dec = _global_scales(amax)
            tl.store(gs_ptr + rows, s_dec, mask=rows < R)
            tl.store(amax_out_ptr + rows, _decode_amax(amax, s_enc), mask=rows < R)
            seen = tl.zeros([BLOCK_R], tl.float32)
            for c0 in range(0, C, BLOCK_C):
                x = _load_tile(x_ptr, stride_r, stride_c, rows, c0, R, C, BLOCK_R, G, RHT, SIGN_MASK, VEC2D)
                bamax = _block_amax(x)
                if FLAG:
                    seen = tl.maximum(seen, _nan_max(bamax, 1), propagate_nan=tl.PropagateNan.ALL)
                _quantize_tile(x, bamax, rows, c0, R, C, s_enc[:, None], s_dec[:, None], sixth,
                               seed_mix, data_ptr, scale_ptr, vals_ptr, scale_row0, 0, 0, C, BLOCK_R, G, BR,
                               STOCHASTIC, WRITE_VALS, VEC2D)
            if FLAG:
                _max_into_flag(flag_ptr, seen)
    else:
        # the global scale from the tensor's amax (the atomic max of `_amax_kernel`, or the caller's), in the
        # reference's operations (`_global_scales`); one program writes what the tensor carries
        amax = tl.load(amax_ptr)
        s_enc, s_dec = _global_scales(amax)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(gs_ptr, s_dec)
            tl.store(amax_out_ptr, _decode_amax(amax, s_enc))
        c0 = pid_c * BLOCK_C
        x = _load_tile(x_ptr, stride_r, stride_c, rows, c0, R, C, BLOCK_R, G, RHT, SIGN_MASK, VEC2D)
        bamax = _block_amax(x)
        if FLAG:
            _max_into_flag(flag_ptr, _nan_max(bamax, 1))
        _quantize_tile(x, bamax, rows, c0, R, C, s_enc, s_dec, sixth, seed_mix,
                       data_ptr, scale_ptr, vals_ptr, scale_row0, 0, 0, C, BLOCK_R, G, BR, STOCHASTIC, WRITE_VALS,
                       VEC2D)


@triton.jit
def _tiles_amax(x_ptr, stride_r, stride_c, R, C, tiles_c, n_tiles, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                RHT: tl.constexpr, SIGN_MASK: tl.constexpr, VEC2D: tl.constexpr, PARTIAL: tl.constexpr = False):
    """max |x| (after the RHT when RHT) over the tiles pid, pid + P, ... (P programs) of an R x C view with tiles_c
    tiles per tile row, as the fp32 bits (int32): for values >= 0 (and NaN, whose bits exceed +inf's) the integer
    order is the float order, so the caller's atomic max of the bits is the float max."""
    pid = tl.program_id(0)
    m = pid * 0  # the bits of +0.0 (int32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        pid_r = t // tiles_c
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c0 = (t - pid_r * tiles_c) * BLOCK_C
        if VEC2D and not RHT:  # a plain 2-D max (no 16-group view needed)
            cols = c0 + tl.arange(0, BLOCK_C)
            ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
            x2 = tl.load(ptrs, mask=(rows < R)[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
            tm = _nan_max(_nan_max(tl.abs(x2), 1), 0)
        else:
            x = _load_tile(x_ptr, stride_r, stride_c, rows, c0, R, C, BLOCK_R, BLOCK_C // 16, RHT, SIGN_MASK, VEC2D,
                           PARTIAL)
            tm = _nan_max(_row_amax(x), 0)
        m = tl.maximum(m, tm.to(tl.int32, bitcast=True))
    return m


@triton.jit
def _amax_kernel(x_ptr, stride_r, stride_c, R, C, amax_bits_ptr, tiles_c, n_tiles,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RHT: tl.constexpr, SIGN_MASK: tl.constexpr,
                 VEC2D: tl.constexpr):
    """max |x| into *amax_bits_ptr (int32, zeroed by the caller): each program's `_tiles_amax`, one atomic max each
    (one per tile on one address cost 60-190 us at 131072 x 2048)."""
    tl.atomic_max(amax_bits_ptr, _tiles_amax(x_ptr, stride_r, stride_c, R, C, tiles_c, n_tiles, BLOCK_R, BLOCK_C, RHT,
                                             SIGN_MASK, VEC2D))


# Tuning knobs, one set per kind of call. Every setting computes the same bits (elementwise math and an exact max;
# tests/kernels checks the addressing variants), so these change speed only. The defaults are what the H200 sweeps
# in tools/bench/bench_nvfp4.py chose (docs/benchmarks.md names each sweep's commit; 131072 x 2048 bf16). At 346e9b1
# (session 9 call 1; the block values stored as 32-bit pairs): codes only, per-row RNE: 4-D addressing, 2048
# elements, 2 warps, 267 us (2-D loads 299 us); codes + fp16 values: 4-D addressing, 1024 elements, 354 us (2-D
# loads/stores 385 us; before the paired stores 2-D was the faster, 425 against 1045 us); transposed views (x^T, dy^T,
# the wgrad operands; RHT + stochastic, values): 32-row tiles of 4096 elements on 8 warps, 1177 us (8192 elements:
# 1451 us, 148 registers against 80; 4-D stores wrote the values element by element before the paired stores).
# With the E2M1 encoding in PTX (a7d93bb, session 21 call 4; a sweep of elems 1024-4096 x warps 1-4 x
# vec2d): codes only on one warp, 1024 elements: per-row RNE 226.7 us (2 warps 238.7), tensor-scope stochastic 550.7
# (561.3); codes + values unchanged (1024 elements, 2 warps: 307.9 us per row; 4 warps 353.4).
# With stochastic rounding in PTX too (session 22 call 1, f0b9fa4): codes + values on one warp, 1024 elements (per row
# 312.7 us against 322.9 on two warps; tensor-scope SR with values 563.9 against 578.7); transposed views (dy^T, RHT +
# SR, values) 64-row tiles of 4096 elements on 4 warps, 889.7 us (32 x 4096 on 8 warps: 976.0; 32 x 8192 on 8 warps
# 898.4); the wgrad column segments unchanged (call 2: 961 us, nine settings 956-1274). In the expert block (call 2)
# the separate per-row quantisation of a with values took 154.7 us (178.8 at 225a6b5, call 1). The "values" tile also
# serves the row-major segments (kernels/nvfp4_segments.py), not timed on their own.
#   elems: fp32 elements one program holds; warps: None = 8 if elems >= 8192 else 4; vec2d: 2-D row loads/stores
#   (16-byte vectors) reshaped to the 4-D view, else 4-D addressing; rows (transposed views only): the tile's rows,
#   the contiguous direction in memory.
# Segments (session 9 call 2): the expert-weight stack 4096 elements on 4 warps, 757 us (8192: 990 us); the wgrad
# column segments (x^T, RHT) 64-row tiles of 4096 elements, 1030 us (32 x 8192: 1170 us).
# amax: at most programs_per_sm x the SM count programs (a CPU: x 1) per amax pass, each looping over tiles (for
# segments, segment_programs_per_sm in all: session 9 call 7 measured the wgrad segments of x^T at 1030 / 986 / 982 us
# with 16 / 64 / 128); a pass
# without the RHT reads x's storage, when x or x.t() is contiguous, in tiles of `elems` elements on `warps` warps
# (`_tensor_amax`; other views take the quantisation's tiles).
# few_rows: a per-row single-pass quantisation with fewer than programs_per_sm x the SM count programs (a rollout's
# activations: 1 to 512 rows of 2048-4096 a decode step, 2048 a batch-64 prefill of 32 tokens) takes at least `warps`
# warps. Session 36, H100, CUDA-graph replays of one launch, bf16 in, fp16 values out (1 / 2 / 4 / 8 warps): 1 x 2048
# 2.89 / 2.29 / 1.99 / 2.02 us, 64 x 2048 3.06 / 2.46 / 2.17 / 2.23, 64 x 4096 5.74 / 3.40 / 2.79 / 2.58, 512 x 2048
# 4.52 / 4.08 / 3.24 / 3.43, 2048 x 2048 10.26 / 8.01 / 6.24 / 8.59. Larger launches (the learner's) keep the tuning
# above (not measured on 4 warps).
TUNING = {
    "plain": {"elems": 1024, "warps": 1, "vec2d": False},
    "values": {"elems": 1024, "warps": 1, "vec2d": False},
    "rht": {"elems": 8192, "warps": None, "vec2d": True},
    "colmajor": {"elems": 4096, "warps": 4, "vec2d": True, "rows": 64},
    "colmajor_segments": {"elems": 4096, "warps": 4, "vec2d": True, "rows": 64},
    "stack": {"elems": 4096, "warps": 4, "vec2d": True},
    "amax": {"programs_per_sm": 16, "segment_programs_per_sm": 64, "elems": 4096, "warps": 4},
    "few_rows": {"programs_per_sm": 16, "warps": 4},
}


def _amax_programs(dev: torch.device, tiles: int, segments: int = 1) -> int:
    """Programs of an amax pass over `tiles` tiles per segment: loads in flight, few atomics per address."""
    sms = sm_count(dev)
    per_sm = TUNING["amax"]["segment_programs_per_sm" if segments > 1 else "programs_per_sm"]
    return max(1, min(tiles, sms * per_sm // segments))


def _warps(tune: dict, block_r: int, block_c: int) -> int:
    """A tuning's warps, or its default (`TUNING`): 8 for tiles of at least 8192 elements, else 4."""
    return tune["warps"] or (8 if block_r * block_c >= 8192 else 4)


def _check_values_dtype(values_dtype) -> None:
    """Block values are stored as 16-bit pairs: fp16 or bf16 (both hold them exactly), or None for none."""
    if values_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"block values are fp16 or bf16 (exact in both), got {values_dtype}")


def _col_major(x: torch.Tensor) -> bool:
    """x is a transposed view: its rows, not its columns, are contiguous in memory."""
    return x.stride(0) == 1 and x.stride(1) != 1 and x.shape[0] > 1


def _tuning(rht: bool, values: bool) -> dict:
    return TUNING["rht" if rht else ("values" if values else "plain")]


def _tile_shape(rows: int, cols: int, br: int, row_scope: bool, budget: int,
                col_major: bool = False, tall: int = 128) -> tuple[int, int, bool]:
    """(BLOCK_R, BLOCK_C, single pass) for one program holding about `budget` elements. col_major: x's rows are
    the contiguous direction (a transposed view, e.g. the wgrad operands x^T): tiles of up to `tall` rows, so that
    each column's read is one contiguous run of rows."""
    full = next_power_of_2(cols)
    if col_major and br == 1 and not row_scope:
        block_r = min(next_power_of_2(rows), tall)
        return block_r, max(16, min(full, budget // block_r)), False
    if row_scope:
        single = full <= MAX_SINGLE_PASS_COLS
        block_c = full if single else 2048
        block_r = max(1, min(64, budget // block_c))
        return block_r, block_c, single
    if br == 16:
        return 16, max(16, min(full, budget // 16)), False
    block_c = min(full, 1024, budget)
    return max(1, min(64, budget // block_c)), block_c, False


def amax_triton(x: torch.Tensor) -> torch.Tensor:
    """max |x| of a 2-D x (any strides) as fp32 0-d on its device: the tensor-scope quantisation's amax pass alone
    (`_tensor_amax`; NaN if x holds a NaN, +0 for an empty x), for an amax taken from a smaller tensor than the one
    quantised (minite.ops.common.abs_max)."""
    ensure_interpreter_compat()
    if x.dim() != 2:
        raise ValueError(f"amax_triton takes a 2-D tensor, got {tuple(x.shape)}")
    bits = torch.zeros((), dtype=torch.int32, device=x.device)
    if x.numel():
        block_r, block_c, _ = _tile_shape(x.shape[0], x.shape[1], 1, False, TUNING["amax"]["elems"])
        _tensor_amax(x, False, block_r, block_c, True, TUNING["amax"]["warps"], bits)
    return bits.view(torch.float32)


def _tensor_amax(x: torch.Tensor, rht: bool, block_r: int, block_c: int, vec2d: bool, warps: int,
                 bits: torch.Tensor) -> None:
    """max |x| (after the RHT when rht) into bits (int32, zeroed): `_amax_kernel` over the quantisation's tiles, or,
    without the RHT, over x's contiguous storage in plain 2-D tiles (TUNING["amax"]): the max does not depend on the
    layout, and a transposed view's storage is its contiguous transpose."""
    if not rht:
        storage = x if x.is_contiguous() else (x.t() if x.t().is_contiguous() else None)
        if storage is not None:
            tune = TUNING["amax"]
            x, vec2d, warps = storage, True, tune["warps"]
            block_r, block_c, _ = _tile_shape(x.shape[0], x.shape[1], 1, False, tune["elems"])
    rows, cols = x.shape
    tiles_c = cdiv(cols, block_c)
    tiles = cdiv(rows, block_r) * tiles_c
    launcher(_amax_kernel)[(_amax_programs(x.device, tiles),)](
        x, x.stride(0), x.stride(1), rows, cols, bits, tiles_c, tiles, BLOCK_R=block_r, BLOCK_C=block_c, RHT=rht,
        SIGN_MASK=RHT_SIGN_MASK, VEC2D=vec2d, num_warps=warps)


def quantize_triton(x: torch.Tensor, block=(1, 16), scale_scope: str = "tensor", rounding: str = "nearest",
                    seed: int | None = None, rht: bool = False, global_amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """Triton twin of minite.nvfp4.quantize_reference (inputs validated by minite.nvfp4.quantize)."""
    q, _ = quantize_with_values_triton(x, block, scale_scope, rounding, seed, rht, values_dtype=None,
                                       global_amax=global_amax)
    return q


def quantize_with_values_triton(x: torch.Tensor, block=(1, 16), scale_scope: str = "tensor",
                                rounding: str = "nearest", seed: int | None = None, rht: bool = False,
                                values_dtype: torch.dtype | None = torch.float16,
                                global_amax: torch.Tensor | None = None, flag: torch.Tensor | None = None):
    """(NVFP4Tensor, block values or None): the quantisation plus, in the same pass, code x block scale in
    `values_dtype` (exact in fp16 and bf16), the operand a block-value GEMM reads without decoding nibbles.
    x may be a strided view (e.g. the transpose of a contiguous tensor, for column-wise wgrad operands).
    global_amax: the amax of the global-scale scope given by the caller (fp32, [] or [rows]); no amax pass then.
    flag: the NaN/Inf flag (fp32, one element, on x's device; minite.ops.FiniteFlag's), which takes max |x| (NaN as
    +Inf) in the same pass: `finite_max_into(x, flag)`'s result without its launch (after the RHT where there is
    one, so a finite input whose transform overflows counts too)."""
    ensure_interpreter_compat()
    _check_values_dtype(values_dtype)
    if flag is not None and (flag.dtype != torch.float32 or flag.numel() != 1 or flag.device != x.device):
        raise ValueError(f"quantize: the NaN/Inf flag must be one fp32 element on {x.device}, got {flag.dtype} "
                         f"{tuple(flag.shape)} on {flag.device}")
    block = tuple(block)
    rows, cols = x.shape
    br = block[0]
    row_scope = scale_scope == "row"
    stochastic = rounding == "stochastic"
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs a seed")
    dev = x.device
    data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(rows // br, cols // 16, dtype=torch.uint8, device=dev)
    vals = torch.empty(rows, cols, dtype=values_dtype, device=dev) if values_dtype is not None else data
    col_major = _col_major(x) and br == 1 and not row_scope
    tune = TUNING["colmajor"] if col_major else _tuning(rht, values_dtype is not None)
    block_r, block_c, single = _tile_shape(rows, cols, br, row_scope, tune["elems"], col_major, tune.get("rows", 128))
    warps = _warps(tune, block_r, block_c)
    if row_scope and single and cdiv(rows, block_r) < TUNING["few_rows"]["programs_per_sm"] * sm_count(x.device):
        # a decode step's activations (one row a program, too few programs to fill the GPU): the row's latency is
        # the cost, so more warps share it; the bits do not depend on the warps (per-row amax, per-element codes)
        warps = max(warps, TUNING["few_rows"]["warps"])
    vec2d = tune["vec2d"]
    given = global_amax.to(device=dev, dtype=torch.float32).contiguous() if global_amax is not None else None
    if row_scope:
        gs = torch.empty(rows, dtype=torch.float32, device=dev)
        amax_out = torch.empty(rows, dtype=torch.float32, device=dev)
        grid = (cdiv(rows, block_r), 1)
        amax_in = given if given is not None else gs  # read only with GIVEN_AMAX
    else:
        gs = torch.empty((), dtype=torch.float32, device=dev)
        amax_out = torch.empty((), dtype=torch.float32, device=dev)
        # at least one program: it writes the scales, also of an empty tensor (all its loads and stores masked)
        grid = (max(1, cdiv(rows, block_r)), max(1, cdiv(cols, block_c)))
        if given is None:  # the amax pass: an atomic max of the fp32 bits; the kernel below derives the scales
            bits = torch.zeros((), dtype=torch.int32, device=dev)
            if x.numel():
                _tensor_amax(x, rht, block_r, block_c, vec2d, warps, bits)
            amax_in = bits.view(torch.float32)
        else:
            amax_in = given.reshape(())
    row_given = row_scope and given is not None
    launcher(_quant_kernel)[grid](
        x, x.stride(0), x.stride(1), rows, cols, data, scale, gs, vals,
        _as_int32_bits(seed_mix(seed)) if stochastic else 0, SIXTH, amax_in, amax_out, gs if flag is None else flag,
        BLOCK_R=block_r, BLOCK_C=block_c, BR=br, ROW_SCOPE=row_scope, SINGLE=single, STOCHASTIC=stochastic, RHT=rht,
        WRITE_VALS=values_dtype is not None, SIGN_MASK=RHT_SIGN_MASK, VEC2D=vec2d, GIVEN_AMAX=row_given,
        FLAG=flag is not None, num_warps=warps)
    q = NVFP4Tensor(data=data, scale=scale.view(torch.float8_e4m3fn), global_scale=gs, shape=(rows, cols),
                    block=block, amax=amax_out)
    return q, (vals if values_dtype is not None else None)
