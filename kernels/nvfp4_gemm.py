"""W4A4 NVFP4 GEMMs in Triton: dense, MoE grouped over tokens (fprop/dgrad), grouped over K (wgrad), small-M decode.

Math (docs/CONTRACTS.md, minite.nvfp4.gemm): out = a @ b^T for a [M, K], b [N, K], both quantised along K:
    acc[m, n] = sum_k bv_a[m, k] * bv_b[n, k]          bv = E2M1 code x E4M3 block scale ("block value")
    out[m, n] = acc[m, n] * ((amax_a[m] * amax_b[n]) * fl(1/(6*6*448*448)))   fp32 (TE's alpha), then out_dtype
A block value has at most 6 significant bits (magnitudes 2^-10..2688), so it is exact in fp16, and a product of two
is exact in fp32: an fp16 tensor-core MMA with fp32 accumulation computes every product exactly and only the fp32
summation differs from the reference's once-rounded float64 sum (tests/tolerances.py). fp16 rather than bf16 operands:
both are exact here, the H200 gave bitwise-equal fp32 results for the two (docs/nvfp4.md, "Exact emulation on
Hopper"), and the Triton interpreter computes fp16 dots correctly but bf16 dots not at all, so one dtype serves the
CPU tests and the GPU.

Operands are read either packed (uint8 nibbles + E4M3 scale bytes, decoded in registers with bit arithmetic:
fp16 bits (c & 7) << 9 times 2^14 is the E2M1 magnitude, fp16 bits (s << 7) times 2^8 is the E4M3 scale) or as
precomputed fp16 block values (the quantisation kernel writes them in the same pass; weights are dequantised once per
weight update). Packed reads move 0.5625 B/element, the decode path for small M where bytes are the cost; block values
skip the decode ALU work, the large-M path where the MMA is the cost.

Batch invariance rules (what makes a row's output independent of M, of the tile shape and of the path):
- one program owns a full [BLOCK_M, BLOCK_N] output tile and walks K from 0 to K in BLOCK_K steps, in order,
  accumulating with tl.dot into one fp32 accumulator: no split-K, no stream-K, no atomics, no reduction whose shape
  depends on M;
- the epilogue is the same fp32 expression everywhere: acc * ((amax_a[m] * amax_b[n]) * FACTOR_INV), then one cast
  (no add, so no fma contraction can change it);
- grouped GEMMs find their expert from a tile table on the device, so expert e's rows see exactly the dense kernel's
  arithmetic; the decode configuration (BLOCK_M=16) differs from the training one (BLOCK_M=128) only in tile shape.
Tile shapes may differ per M bucket only because the GPU tests prove bitwise equality of rows across them on the H200
(docs/nvfp4.md, "Exact emulation on Hopper": measured for bf16 Triton matmuls with sequential K for BLOCK_M 16..128,
BLOCK_K 32/64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minite.nvfp4.device_copy import int32_to
from minite.nvfp4.grouped import NVFP4Stack
from minite.nvfp4.tensor import FACTOR_INV, NVFP4Tensor

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher, next_power_of_2

VALUES_DTYPE = torch.float16
PTX_DECODE = True
"""Decode packed operands with inline PTX on the GPU (False: the Triton decode, same bits; benchmarks compare them)."""


# PTX of the packed decode on the GPU: four bytes in, per byte b one register holding the fp16 bits of its two codes
# x 2^-14 (low nibble in the low half). With y = b | b << 12 (b * 0x1001) both nibbles sit alike in their halves: the
# magnitude bits 0..2 go to 9..11 (y << 9), the sign bit 3 to 15 (y << 12); the shifted y come from one multiply each.
_E2M1_X2_PTX = tl.constexpr("""{
.reg .b32 b, y9, y12, t;
prmt.b32 b, $4, 0, 0x4440;
mul.lo.u32 y9, b, 0x200200;
mul.lo.u32 y12, b, 0x1001000;
and.b32 t, y12, 0x80008000;
and.b32 y9, y9, 0x0E000E00;
or.b32 $0, y9, t;
prmt.b32 b, $4, 0, 0x4441;
mul.lo.u32 y9, b, 0x200200;
mul.lo.u32 y12, b, 0x1001000;
and.b32 t, y12, 0x80008000;
and.b32 y9, y9, 0x0E000E00;
or.b32 $1, y9, t;
prmt.b32 b, $4, 0, 0x4442;
mul.lo.u32 y9, b, 0x200200;
mul.lo.u32 y12, b, 0x1001000;
and.b32 t, y12, 0x80008000;
and.b32 y9, y9, 0x0E000E00;
or.b32 $2, y9, t;
prmt.b32 b, $4, 0, 0x4443;
mul.lo.u32 y9, b, 0x200200;
mul.lo.u32 y12, b, 0x1001000;
and.b32 t, y12, 0x80008000;
and.b32 y9, y9, 0x0E000E00;
or.b32 $3, y9, t;
}""")

# A packed operand's block values enter the MMA as v * 2^-PACKED_SHIFT (one fp16 multiply of a code by a
# pre-scaled block scale, exact: |v| * 2^-7 is in [2^-17, 21], every value has <= 6 significant bits, and fp16 holds
# such values exactly down to 2^-24); the accumulator is multiplied back by 2^PACKED_SHIFT (exact in fp32). Products and
# sums in the MMA are all scaled by the same power of two, which changes no bit of their fp32 arithmetic (no fp32
# subnormal is reached), so the result equals the fp16-values path bit for bit (GPU tests, marker gpu).
PACKED_SHIFT = 7  # _unshift multiplies by 128.0 = 2^PACKED_SHIFT per packed operand


# The decode order's words (minite.nvfp4.grouped.DECODE_BLOCK: pair i's magnitudes 3i bits below 9..11, its sign
# WORD_SIGN_BIT below 15): pair i of word w is ((w << 3i) & MAG) | ((w << (0, 3, 1, 2)[i]) & SIGN), int32 constants.
_MAG = tl.constexpr(0x0E000E00)
_SIGN = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32
_MAG_SIGN = tl.constexpr(-0x71FF7200)  # 0x8E008E00 as int32


@triton.jit
def _word_codes(data_ptr, rows, rmask, k0, kmax, stride_d, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                MOV: tl.constexpr, EVEN_K: tl.constexpr):
    """fp16 bits of code x 2^-14 [BLOCK_R, BLOCK_K] (the packed decode's `mag`) of rows `rows`, columns k0.., read as
    the decode order's words (K % 128 == 0, k0 and BLOCK_K multiples of 128). The two codes of a pair are one 32-bit
    register. MOV (the GPU, when the tile is the MMA's register operand): one inline `mov` hands that register to
    Triton as the pair's two fp16 elements (pack=2; no repacking of halves). It relies on each pack of two being one
    pair, which holds in the MMA operand's register layout (pairs of K) but not in every blocked layout: a 64x64x128
    tile that decodes before its shared-memory store gave other bits (H200, 2026-12-01). Otherwise each element takes
    its half with a shift, in any layout."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kw = tl.max_contiguous(tl.multiple_of(kw, BLOCK_K // 8), BLOCK_K // 8)
    w_ptrs = data_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * tl.multiple_of(stride_d // 4, 16) \
        + kw[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs, mask=rmask[:, None], other=0)
    else:
        w = tl.load(w_ptrs, mask=rmask[:, None] & (kw < kmax // 8)[None, :], other=0)
    p0 = w & _MAG_SIGN
    p1 = (w << 3) & _MAG_SIGN
    p2 = ((w << 6) & _MAG) | ((w << 1) & _SIGN)
    p3 = ((w << 9) & _MAG) | ((w << 2) & _SIGN)
    pairs = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [BLOCK_R, BLOCK_K // 8, 4])  # pair i at [:, :, i]
    pairs = tl.broadcast_to(pairs[:, :, :, None], [BLOCK_R, BLOCK_K // 8, 4, 2])
    if MOV:
        mag = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.reshape(pairs, [BLOCK_R, BLOCK_K])],
                                        dtype=tl.float16, is_pure=True, pack=2)
    else:
        half = tl.arange(0, 2)[None, None, None, :]
        mag = tl.reshape(((pairs >> (16 * half)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
                         [BLOCK_R, BLOCK_K])
    # element (word 4t + q, pair 2a + b, half h) of a 128-code block is its code 32q + 16a + 8b + 2t + h
    return tl.reshape(tl.permute(tl.reshape(mag, [BLOCK_R, BLOCK_K // 128, 4, 4, 2, 2, 2]), [0, 1, 3, 4, 5, 2, 6]),
                      [BLOCK_R, BLOCK_K])


@triton.jit
def _operand_tile(data_ptr, scale_ptr, vals_ptr, rows, rmask, k0, kmax, stride_d, stride_s, stride_v,
                  SBR: tl.constexpr, PACKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  PTX: tl.constexpr = False, EVEN_K: tl.constexpr = False, DECODE_ORDER: tl.constexpr = False,
                  K0_ALIGNED: tl.constexpr = False, REG_OPERAND: tl.constexpr = False,
                  F16_SCALES: tl.constexpr = False):
    """fp16 block values [BLOCK_R, BLOCK_K] of rows `rows`, columns k0..k0+BLOCK_K (zero at and beyond kmax); a packed
    operand's are scaled by 2^-PACKED_SHIFT (module comment above). EVEN_K: kmax is a multiple of BLOCK_K (no column
    mask). K0_ALIGNED: k0 is a multiple of BLOCK_K (the grouped kernel; not the K-grouped one, whose segments start at
    multiples of 16). Row strides are multiples of 8 codes (K % 16 == 0): with the column mask gone, the hints let the
    loads be vectors (byte loads otherwise, the packed path's cost on the H200). DECODE_ORDER (K % 128 == 0): the
    codes are the decode order's words and a row of scales is a multiple of 8 scales, which lets the scale loads be
    asynchronous copies too (with byte loads Triton loaded them synchronously in every K step). F16_SCALES: scale_ptr
    holds the scales already decoded, fp16 scale x 2^PACKED_SHIFT (`decode_scales`), and no bits are decoded."""
    if PACKED:
        # (a 4-D [rows, group, byte, nibble] variant of this decode crashed Triton 3.6's dot-operand pass on sm_90)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        if DECODE_ORDER:
            ks = tl.max_contiguous(tl.multiple_of(ks, BLOCK_K // 16), BLOCK_K // 16)
            stride_s = (stride_s // 8) * 8  # the same value, with its divisibility known to the compiler
        s_ptrs = scale_ptr + (rows // SBR)[:, None].to(tl.int64) * stride_s + ks[None, :]
        if EVEN_K:
            s = tl.load(s_ptrs, mask=rmask[:, None], other=0)
        else:
            s = tl.load(s_ptrs, mask=rmask[:, None] & (ks < kmax // 16)[None, :], other=0)
        if DECODE_ORDER:
            mag = _word_codes(data_ptr, rows, rmask, k0, kmax, stride_d, BLOCK_R, BLOCK_K, PTX and REG_OPERAND, EVEN_K)
        else:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            if K0_ALIGNED:
                kb = tl.max_contiguous(tl.multiple_of(kb, BLOCK_K // 2), BLOCK_K // 2)
            d_ptrs = data_ptr + rows[:, None].to(tl.int64) * tl.multiple_of(stride_d, 8) + kb[None, :]
            if EVEN_K:
                d = tl.load(d_ptrs, mask=rmask[:, None], other=0)
            else:
                d = tl.load(d_ptrs, mask=rmask[:, None] & (kb < kmax // 2)[None, :], other=0)
            if PTX:  # the same bits as the branch below, in 2.75 integer ops per code instead of ~6
                pair = tl.inline_asm_elementwise(_E2M1_X2_PTX, "=r,=r,=r,=r,r", [d], dtype=tl.int32, is_pure=True,
                                                 pack=4)
                lo = pair.to(tl.int16).to(tl.float16, bitcast=True)
                hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
                mag = tl.reshape(tl.join(lo, hi), [BLOCK_R, BLOCK_K])
            else:
                c = tl.reshape(tl.join(d & 15, d >> 4), [BLOCK_R, BLOCK_K]).to(tl.uint16)
                mag = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)  # e2m1 * 2^-14
        if F16_SCALES:
            sc = s
        else:
            # E4M3 bits (s & 0x7F) << 7 as fp16 are the scale * 2^-8; times 2^15 (exact, <= 448 * 2^7 = 57344)
            sc = ((s.to(tl.uint16) & 0x7F) << 7).to(tl.float16, bitcast=True) * tl.full([], 32768.0, tl.float16)
        v = tl.reshape(mag, [BLOCK_R, BLOCK_K // 16, 16]) * sc[:, :, None]  # e2m1 * scale * 2^-7, exact
        return tl.reshape(v, [BLOCK_R, BLOCK_K])
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        if K0_ALIGNED:
            kk = tl.max_contiguous(tl.multiple_of(kk, BLOCK_K), BLOCK_K)
        v_ptrs = vals_ptr + rows[:, None].to(tl.int64) * tl.multiple_of(stride_v, 16) + kk[None, :]
        if EVEN_K:
            return tl.load(v_ptrs, mask=rmask[:, None], other=0.0)
        return tl.load(v_ptrs, mask=rmask[:, None] & (kk < kmax)[None, :], other=0.0)


@triton.jit
def _b_tile(bd, bs, bv, cols, cmask, k0, N, K, B_SBR: tl.constexpr, B_PACKED: tl.constexpr, B_TRANS: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, EVEN_K: tl.constexpr,
            DECODE_ORDER: tl.constexpr = False, REG_OPERAND: tl.constexpr = False, F16_SCALES: tl.constexpr = False):
    """fp16 block values [BLOCK_N, BLOCK_K] of b rows `cols`: from b [N, K] (packed or values), or with B_TRANS
    from the values of b^T [K, N] (element (n, k) at k * N + n). k0: a multiple of BLOCK_K (the grouped kernel).
    REG_OPERAND: the tile is the MMA's register operand (SWAP_AB)."""
    if B_TRANS:
        kk = k0 + tl.arange(0, BLOCK_K)
        return tl.load(bv + kk[None, :].to(tl.int64) * N + cols[:, None], mask=cmask[:, None] & (kk < K)[None, :],
                       other=0.0)
    else:
        return _operand_tile(bd, bs, bv, cols, cmask, k0, K, K // 2, K // 16, K, B_SBR, B_PACKED, BLOCK_N, BLOCK_K,
                             PTX, EVEN_K, DECODE_ORDER, True, REG_OPERAND, F16_SCALES)


@triton.jit
def _unshift(acc, A_PACKED: tl.constexpr, B_PACKED: tl.constexpr):
    """Undo the 2^-PACKED_SHIFT of each packed operand (exact in fp32)."""
    if A_PACKED:
        acc = acc * 128.0
    if B_PACKED:
        acc = acc * 128.0
    return acc


@triton.jit
def _load_f32(ptr, offs, mask):
    """A bf16/fp16/fp32 load converted to fp32 exactly; bf16 by its bits (Triton's interpreter flushes bf16
    subnormals to zero in its cast; the GPU's conversion is this shift). Masked lanes read 0. The load beside
    `_cast_out`'s store, for the kernels here and strict mode's (minite.strict.fused)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        hi = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        return (hi.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _cast_out(x, out_ty: tl.constexpr):
    """fp32 -> out dtype. bf16 rounds to nearest even in integer arithmetic first (Triton's interpreter truncates
    fp32 -> bf16; on the GPU the cast is already RNE, so this is the same value), then the cast is exact. A NaN is
    cast as it is (the rounding carry would turn the GPU's NaN 0x7FFFFFFF into -0.0)."""
    if out_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    else:
        return x.to(out_ty)


@triton.jit
def _grouped_gemm_kernel(a_data, a_scale, a_vals, a_amax, a_amax_stride,
                         b_data, b_scale, b_vals, b_amax, b_amax_stride_e, b_amax_stride_n,
                         c_ptr, count_ptr, single_rows, E, N, K, factor_inv,
                         A_SBR: tl.constexpr, B_SBR: tl.constexpr, A_PACKED: tl.constexpr, B_PACKED: tl.constexpr,
                         BLOCK_E: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SWAP_AB: tl.constexpr, B_TRANS: tl.constexpr = False, PTX: tl.constexpr = False,
                         EVEN_K: tl.constexpr = False, DECODE_ORDER: tl.constexpr = False,
                         B_F16_SCALES: tl.constexpr = False, SINGLE: tl.constexpr = False):
    """c[rows of expert e] = a[rows] @ b[e]^T, for rows grouped contiguously by expert (counts per expert).
    B_TRANS: b[e] is given as the block values of its transpose, [K, N] row-major (dgrad reads the forward
    weight's values in place); the tiles hold the same values, so the result is bitwise the same.
    PTX: decode packed operands with inline PTX (the GPU; the interpreter runs the Triton decode, same bits).
    B_F16_SCALES: b_scale holds b's scales decoded to fp16 (`decode_scales`; with DECODE_ORDER).
    SINGLE: one group of `single_rows` rows (a dense GEMM), count_ptr not read."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    t = pid // num_n
    pn = pid % num_n
    # The tile table, computed by every program from the counts (E ints, cached): no extra launch, no host sync.
    ei = tl.arange(0, BLOCK_E)
    if SINGLE:  # a dense GEMM: its row count as an argument, no counts tensor (nor a launch that fills one)
        cnt = tl.where(ei == 0, single_rows, 0)
    else:
        cnt = tl.load(count_ptr + ei, mask=ei < E, other=0).to(tl.int32)  # int32 or int64 (`_as_group_tensors`)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(cnt, 0)
    e = tl.sum((tile_end <= t).to(tl.int32), 0)  # experts whose tiles all come before tile t
    if e >= E:
        return
    sel = ei == e
    local = t - tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
    end = tl.sum(tl.where(sel, row_end, 0), 0)
    start = end - tl.sum(tl.where(sel, cnt, 0), 0)
    rows = start + local * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < end
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    e64 = e.to(tl.int64)
    bd = b_data + e64 * N * (K // 2)
    if DECODE_ORDER:  # K % 128 == 0: a row of scales is a multiple of 8 scales (the compiler is told so)
        bs = b_scale + e64 * (N // B_SBR) * ((K // 128) * 8)
    else:
        bs = b_scale + e64 * (N // B_SBR) * (K // 16)
    bv = b_vals + e64 * N * K
    if SWAP_AB:  # out^T = b @ a^T: the weight tile is the MMA's first operand (small-M decode variant)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # fixed, sequential K order: the batch-invariance rule
            a = _operand_tile(a_data, a_scale, a_vals, rows, rmask, k0, K, K // 2, K // 16, K,
                              A_SBR, A_PACKED, BLOCK_M, BLOCK_K, PTX, EVEN_K,
                              K0_ALIGNED=True)
            b = _b_tile(bd, bs, bv, cols, cmask, k0, N, K, B_SBR, B_PACKED, B_TRANS, BLOCK_N, BLOCK_K, PTX, EVEN_K,
                        DECODE_ORDER, True, B_F16_SCALES)
            acc_t = tl.dot(b, tl.trans(a), acc_t)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # fixed, sequential K order: the batch-invariance rule
            a = _operand_tile(a_data, a_scale, a_vals, rows, rmask, k0, K, K // 2, K // 16, K,
                              A_SBR, A_PACKED, BLOCK_M, BLOCK_K, PTX, EVEN_K,
                              K0_ALIGNED=True)
            b = _b_tile(bd, bs, bv, cols, cmask, k0, N, K, B_SBR, B_PACKED, B_TRANS, BLOCK_N, BLOCK_K, PTX, EVEN_K,
                        DECODE_ORDER, False, B_F16_SCALES)
            acc = tl.dot(a, tl.trans(b), acc)
    acc = _unshift(acc, A_PACKED, B_PACKED)
    ama = tl.load(a_amax + rows * a_amax_stride, mask=rmask, other=0.0)
    amb = tl.load(b_amax + e64 * b_amax_stride_e + cols * b_amax_stride_n, mask=cmask, other=0.0)
    out = acc * ((ama[:, None] * amb[None, :]) * factor_inv)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c_ptrs, _cast_out(out, c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@dataclass
class GemmConfig:
    """Tile shape of one launch. Any shape computes the same bits (fixed K order); shapes differ only in speed."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    """Compute out^T = b @ a^T (weights as the first MMA operand); used only where the GPU tests prove it bitwise.
    With decode-order weights a swapped tile hands registers to Triton with an inline mov whose correctness depends
    on the layout Triton picks (`_word_codes`): the tiles of `default_config` and the benchmarks' candidates were
    proven on the H200; a tile outside them needs that GPU test first."""


FEW_PROGRAMS = 132
"""The H200's SM count: a launch of fewer training tiles than this leaves SMs idle (`default_config`)."""


def default_config(rows_per_group: int, interpreter: bool, packed: bool = False, *, ordered: bool = False,
                   rows: int | None = None, n: int | None = None, k: int | None = None,
                   dense: bool = False) -> GemmConfig:
    """Training-sized tiles for many rows per group, decode tiles (BLOCK_M=16, narrow N, long K) for few; packed
    weights (the nibble decode is the cost) take 32-row tiles from 9 rows per group on, 128 columns wide in the decode
    order (`ordered`); up to 8 rows per group in the decode order with K >= 2048 (the experts' FC1) read K 256 at a
    time. rows, n: the launch's total rows and N; where the training tile would make fewer programs
    than FEW_PROGRAMS at up to 256 rows (a dense layer at a rollout's decode batch; larger launches were not measured)
    a 64x64 tile takes its place. dense: one group of every row (a launch without counts, SINGLE); of packed weights
    in the decode order at up to 256 rows (a rollout's dense linear on packed weights,
    megatron_patches.nvfp4_layers.DENSE_PACKED_KERNEL) it takes swapped 16-row tiles reading K 256 at a time up to 64
    rows, 32-row tiles above (an expert launch with one expert keeps the experts' tiles)."""
    if interpreter:
        return GemmConfig(16, 32, 64, 4, 1)
    # measured on the H200 (docs/benchmarks.md): FC1 of the expert block, 131072 rows, 128x256x64: 525 TFLOP/s
    # (128x128x64: 453); decode of 8 experts' FC1 with 1..16 tokens each: 16x64x128 with swapped operands 22.6 us
    # (unswapped 29.4-30.7 us), 32 tokens: 32x64x128 swapped 28.6 us (unswapped 44.0 us); all bitwise equal to the
    # training tile in the same run and in the GPU tests (marker gpu).
    # packed weights in the decode order (bench_nvfp4.py --sections rollout_gemm, 2026-11-30, f5b08c7): 128 experts,
    # 4 rows each: FC1 16x64x128 swapped 140.2 us (32 rows: 162.3); 16 rows each: 16x64x128 197.4, 32x64x128 167.5;
    # the decode order as words (70f8ceb, session 8 call 1): 4 rows each 16x64x128 swapped 96.2 us (16x128x128 93.5),
    # 0.5 rows each 44.7 us, 16 rows each 32x64x128 swapped 119.5 us; with fp16 scales (2026-12-04, session 20 call
    # 3), 16 rows each: FC1 32x128x128 3 stages 98.5 us, FC2 55.9 (32x64x128 4 stages 105.3, 66.7); a dense output
    # projection (N 2048, K 4096, fp16 values) at 256 rows: 128x256x64 51.9 us (16 programs), 64x64x128 17.5;
    # the rollout slice's expert GEMMs on an H100 (2026-12-06, session 38 call 3, rollout-gemm-h100.json in
    # docs/benchmarks, each tile bitwise the training tile's): FC1 (K 2048) 16x64x256 with 3 stages 13.7 / 42.1 /
    # 92.9 us at batch 1 / 8 / 64 against 16x64x128's 14.5 / 45.6 / 95.5; FC2 (K 768) slower with it (61.3 against
    # 53.8 at batch 64)
    # the slice's dense linears on packed weights in the decode order (2026-12-07, session 40, H100,
    # rollout-dense-h100-5eedc48.json, each bitwise the training tile): QKV (N 5120, K 2048) / output projection
    # (N 2048, K 4096) 16x64x256 swapped 8.1 / 12.2 us at 1 and 8 rows, 12.3 / 12.2 at 64 (64x64x128: 21.2 / 39.4;
    # fp16 values at the shipped tile 10.8 / 12.7 and 12.3 / 15.1); 32x64x128 swapped 24.4 / 19.8 at 256 (values 27.9
    # / 16.5)
    if packed and ordered and dense and rows is not None and rows <= 256:
        if rows <= 64:
            return GemmConfig(16, 64, 256, 4, 3, swap_ab=True) if k is not None and k % 256 == 0 \
                else GemmConfig(16, 64, 128, 4, 4, swap_ab=True)
        return GemmConfig(32, 64, 128, 4, 4, swap_ab=True)
    if rows_per_group <= (8 if packed else 16):
        if packed and ordered and k is not None and k >= 2048:
            return GemmConfig(16, 64, 256, 4, 3, swap_ab=True)
        return GemmConfig(16, 64, 128, 4, 4, swap_ab=True)
    if rows_per_group <= 32:
        if packed and ordered:
            return GemmConfig(32, 128, 128, 4, 3, swap_ab=True)
        return GemmConfig(32, 64, 128, 4, 4, swap_ab=True)
    if rows_per_group <= 64:
        return GemmConfig(64, 64, 128, 4, 4)
    if rows is not None and n is not None and rows <= 256 and cdiv(rows, 128) * cdiv(n, 256) < FEW_PROGRAMS:
        return GemmConfig(64, 64, 128, 4, 4)
    return GemmConfig(128, 256, 64, 8, 3)


@dataclass
class ExpertWeights:
    """Expert weights stacked for the grouped kernels: done once per weight update, not per call.

    data uint8 [E, N, K/2] (None with values: a values-only stack, NVFP4Stack.drop_codes), scale uint8
    [E, N/br, K/16], amax fp32 [E, N] (or [E, 1] broadcast: each expert's decode amax, NVFP4Tensor.amax), values
    fp16 [E, N, K] block values or None (then the kernel decodes the packed nibbles).
    """

    data: torch.Tensor | None
    scale: torch.Tensor
    amax: torch.Tensor
    values: torch.Tensor | None
    block_rows: int
    shape: tuple[int, int]
    decode_data: torch.Tensor | None = None
    """The codes again in the decode order (minite.nvfp4.decode_order) or None: read instead of data by packed
    launches whose tile allows it (BLOCK_K % 128 == 0, no transpose)."""
    decode_scale: torch.Tensor | None = None
    """fp16 [E, N/br, K/16], the scales decoded (minite.nvfp4.decode_scales) or None: read instead of scale by the
    launches that read decode_data."""

    @property
    def num_experts(self) -> int:
        return self.scale.shape[0]


def _from_stack(st: NVFP4Stack) -> ExpertWeights:
    """The kernels' view of an NVFP4Stack (no copy): amaxes as [E, 1] or [E, N]."""
    if st.amax is None:
        raise ValueError("NVFP4Stack has no amax (the GEMM alpha needs it): build it with quantize_stack or "
                         "NVFP4Stack.from_tensors of quantised tensors, or pass amax=")
    am = st.amax if st.amax.dim() == 2 else st.amax.reshape(-1, 1)
    return ExpertWeights(st.data, st.scale.view(torch.uint8), am, st.values, st.block[0], st.shape, st.decode_data,
                         st.decode_scale)


def stack_expert_weights(weights: list[NVFP4Tensor], values: bool = False, decode: bool = False) -> ExpertWeights:
    """Stack per-expert NVFP4 weights [N, K]; with values=True also keep fp16 block values for large-M GEMMs, with
    decode=True the codes in the decode order and the scales decoded for small-M GEMMs on packed weights."""
    st = NVFP4Stack.from_tensors(weights)
    if values:
        st.values = torch.stack([w.block_values(VALUES_DTYPE) for w in weights])
    if decode:
        st.keep_decode_order()
    return _from_stack(st)


def _as_group_tensors(tokens_per_expert, experts: int, device) -> torch.Tensor:
    """The counts as the kernel reads them: a contiguous int32 or int64 tensor on `device` as it is (the kernel loads
    either as int32; the dispatch's int64 counts take no conversion launch per GEMM), anything else copied to int32."""
    t = tokens_per_expert
    if torch.is_tensor(t) and t.device == device and t.dtype in (torch.int32, torch.int64) and t.dim() == 1 \
            and t.is_contiguous():
        counts = t
    else:
        # no stream synchronisation (minite.nvfp4.device_copy); a strided int32 device tensor comes back as it is
        counts = int32_to(tokens_per_expert, device).reshape(-1).contiguous()
    if counts.numel() != experts:
        raise ValueError(f"{counts.numel()} token counts for {experts} experts")
    return counts


def grouped_gemm_triton(a: NVFP4Tensor, weights, tokens_per_expert, out_dtype=torch.float32, *,
                        a_values: torch.Tensor | None = None, config: GemmConfig | None = None,
                        rows_hint: int | None = None, transpose_weights: bool = False) -> torch.Tensor:
    """Per-expert a_e @ w_e^T over rows of `a` grouped contiguously by expert; returns [T, N] in out_dtype.

    weights: a list of NVFP4Tensor [N, K], an NVFP4Stack or an ExpertWeights (stacked once; with values it reads fp16
    block values). a_values: fp16 block values of `a` (default: a.values); without them the packed codes are read.
    No host synchronisation: the expert of each tile comes from a device-side table, so the call can be captured in a
    CUDA graph. rows_hint (rows per expert, for the tile choice) defaults to T / E. tokens_per_expert None: one
    expert's weights and all T rows its group (a dense GEMM; the count is a kernel argument).
    transpose_weights: compute a_e @ w_e instead (the MoE dgrad with 16x16-block weights, whose transpose is exact):
    with an NVFP4Stack or ExpertWeights carrying values (contiguous [E, N, K], one amax per expert) the kernel reads
    them transposed in place, otherwise a stack or list is transposed.
    """
    ensure_interpreter_compat()
    b_trans = False
    if transpose_weights:
        if isinstance(weights, (NVFP4Stack, ExpertWeights)) and weights.values is not None:
            b_trans = True
        elif isinstance(weights, ExpertWeights):
            raise ValueError("transpose_weights: ExpertWeights without block values cannot be transposed; pass the "
                             "NVFP4Stack (or the list of NVFP4Tensors) instead")
        else:
            weights = weights.t() if isinstance(weights, NVFP4Stack) else [w.t() for w in weights]
    if isinstance(weights, ExpertWeights):
        w = weights
    elif isinstance(weights, NVFP4Stack):
        w = _from_stack(weights)
    else:
        w = stack_expert_weights(list(weights))
    a_values = a.values if a_values is None else a_values
    if b_trans and (w.block_rows != 16 or w.amax.shape[1] > 1 or not w.values.is_contiguous()):
        raise ValueError("transpose_weights reads the block values transposed in place: it needs 16x16 blocks, one "
                         "amax per expert and contiguous values")
    t_rows, k = a.shape
    kw, n = w.shape if b_trans else w.shape[::-1]
    if k != kw:
        raise ValueError(f"K mismatch: a is {a.shape}, weights are {w.shape}")
    experts = w.num_experts
    dev = a.data.device
    single = tokens_per_expert is None
    if single and experts != 1:
        raise ValueError(f"tokens_per_expert None (one group of all rows) needs one expert's weights, got {experts}")
    cfg = config or default_config(rows_hint or max(1, t_rows // experts), interpreting(), w.values is None,
                                   ordered=w.decode_data is not None and not b_trans, rows=t_rows, n=n, k=k,
                                   dense=single)
    out = torch.empty(t_rows, n, dtype=out_dtype, device=dev)
    counts = out if single else _as_group_tensors(tokens_per_expert, experts, dev)  # out: a pointer never read
    max_tiles = cdiv(t_rows, cfg.block_m) + experts
    grid = (max_tiles * cdiv(n, cfg.block_n),)
    a_packed = a_values is None
    b_packed = w.values is None
    in_order = b_packed and w.decode_data is not None and cfg.block_k % 128 == 0 and k % 128 == 0 and not b_trans
    # a values-only stack (NVFP4Stack.drop_codes) has no codes: its values stand in for the pointer, never read
    # without B_PACKED (another dtype there: one more Triton specialisation, same bits)
    b_data = w.decode_data if in_order else w.values if w.data is None else w.data
    f16_scales = in_order and w.decode_scale is not None
    launcher(_grouped_gemm_kernel)[grid](
        a.data, a.scale.view(torch.uint8), a.data if a_packed else a_values, a.decode_amax(),
        1 if a.per_row else 0,
        b_data, w.decode_scale if f16_scales else w.scale, b_data if b_packed else w.values, w.amax, w.amax.stride(0),
        1 if w.amax.shape[1] > 1 else 0,
        out, counts, t_rows if single else 0, experts, n, k, FACTOR_INV,
        A_SBR=a.block[0], B_SBR=w.block_rows, A_PACKED=a_packed, B_PACKED=b_packed,
        BLOCK_E=max(16, next_power_of_2(experts)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab, B_TRANS=b_trans,
        PTX=PTX_DECODE and not interpreting(), EVEN_K=k % cfg.block_k == 0, DECODE_ORDER=in_order,
        B_F16_SCALES=f16_scales, SINGLE=single, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def gemm_triton(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype=torch.float32, *, a_values=None, b_values=None,
                config: GemmConfig | None = None, transpose_b: bool = False) -> torch.Tensor:
    """a @ b^T for NVFP4 a [M, K], b [N, K]: the grouped kernel with one group (same arithmetic per row).
    Block values default to the operands' own (`NVFP4Tensor.values`) when they carry them.
    transpose_b: a @ b for a 16x16-block b [N, K] (a [M, N]); b's block values are read transposed in place, a b
    without them is transposed (`NVFP4Tensor.t()`, exact)."""
    b_values = b.values if b_values is None else b_values
    if transpose_b and b_values is None:
        b, transpose_b = b.t(), False
    w = ExpertWeights(None if b.data is None else b.data[None], b.scale.view(torch.uint8)[None],
                      b.decode_amax().reshape(1, -1).float(), None if b_values is None else b_values[None],
                      b.block[0], b.shape)
    m = a.shape[0]
    return grouped_gemm_triton(a, w, None, out_dtype, a_values=a_values, config=config, rows_hint=m,
                               transpose_weights=transpose_b)  # one group of m rows: no counts tensor
