"""NVFP4 quantisation of B rectangles (segments) of one tensor in one amax launch and one quantisation launch, each
segment as its own tensor (one global scale, its own seed): the expert-weight stacks (16x16 blocks, one segment per
expert) and the MoE wgrad operands (x^T, dy^T: one column segment per expert, zero-padded to a multiple of 16 tokens
inside the kernel). The tile arithmetic is kernels/nvfp4_quant.py's (`_load_tile`, `_quantize_tile`), so every
segment's bits are that kernel's, and the reference's, on the segment alone.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import nvfp4_quant as nq
from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher, next_power_of_2
from .nvfp4_quant import (RHT_SIGN_MASK, SIXTH, _block_amax, _decode_amax, _global_scales, _load_tile,
                          _quantize_tile, _tiles_amax)
from .nvfp4_seeds import seed_mixes
from minite.nvfp4.device_copy import host_to


@triton.jit
def _segment(table_ptr, b, ROWS16: tl.constexpr, XC16: tl.constexpr):
    """Row b of a segment table int64 [B, 7]: x row, x column, rows, columns, output row, output column, and the
    columns read from x (at most the columns; the rest of the segment is zero padding, which the kernels write). The
    host checked that columns and output columns are multiples of 16; XC16 says that the x columns and the columns
    read are too, and ROWS16 that the rows, x rows and output rows of every segment are; saying so lets the compiler
    vectorise the loads and stores (a masked 16-byte access needs its mask constant over the vector): without it the
    expert-weight stacks ran at 0.86 TB/s against 2 TB/s for the same bytes as one tensor (docs/benchmarks.md)."""
    t = table_ptr + b * 7
    xr, xc, r, c = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.multiple_of(tl.load(t + 3), 16)
    orow, ocol, cl = tl.load(t + 4), tl.multiple_of(tl.load(t + 5), 16), tl.load(t + 6)
    if XC16:
        xc, cl = tl.multiple_of(xc, 16), tl.multiple_of(cl, 16)
    if ROWS16:
        xr, r, orow = tl.multiple_of(xr, 16), tl.multiple_of(r, 16), tl.multiple_of(orow, 16)
    return xr, xc, r, c, orow, ocol, cl


@triton.jit
def _count_geometry(cnt, ei, b):
    """Segment b of the count layout from the E counts `cnt` (int32 lanes `ei`, zero past E): x's first column of
    it, the columns read (its count), its columns (the count padded to a multiple of 16) and its first output column
    (the padded counts before it), as int64 like a table's entries. The widths are products by 16, which the
    compiler knows to be multiples of 16 (a hint on a reduction's result is lost: the values' stores were not
    vectorised, sass_census.py --quant). int32 sums: T + 15 E < 2^31."""
    blocks = (cnt + 15) // 16  # the padded width in 16-column blocks
    before = ei < b
    sel = ei == b
    xc = tl.sum(tl.where(before, cnt, 0), 0).to(tl.int64)
    c = tl.sum(tl.where(sel, cnt, 0), 0).to(tl.int64)
    cols = tl.sum(tl.where(sel, blocks, 0), 0).to(tl.int64) * 16
    ocol = tl.sum(tl.where(before, blocks, 0), 0).to(tl.int64) * 16
    return xc, c, cols, ocol


@triton.jit
def _load_counts(count_ptr, E, BLOCK_E: tl.constexpr):
    """The E counts (int32, on the device) as BLOCK_E lanes, zero past E, and the lane indices. Every program reads
    them (cached) and sums them itself: no table, no launch, no host synchronisation (as the grouped GEMM's tiles)."""
    ei = tl.arange(0, BLOCK_E)
    return tl.load(count_ptr + ei, mask=ei < E, other=0), ei


@triton.jit
def _count_segment(count_ptr, b, E, BLOCK_E: tl.constexpr):
    """Segment b of the count layout (`quantize_count_segments_triton`), as `_count_geometry`."""
    cnt, ei = _load_counts(count_ptr, E, BLOCK_E)
    return _count_geometry(cnt, ei, b)


@triton.jit
def _count_tile(count_ptr, t, E, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """Flat column tile t over the segments' tiles in order: its segment b (E past the last), its column tile in
    the segment, and the segment as `_count_geometry` gives it, from one read of the counts."""
    cnt, ei = _load_counts(count_ptr, E, BLOCK_E)
    tiles = ((cnt + 15) // 16 * 16 + BLOCK_C - 1) // BLOCK_C
    tile_end = tl.cumsum(tiles, 0)
    b = tl.sum((tile_end <= t).to(tl.int32), 0)
    local = t - tl.sum(tl.where(ei == b, tile_end - tiles, 0), 0)
    xc, c, cols, ocol = _count_geometry(cnt, ei, b)
    return b, local, xc, c, cols, ocol


@triton.jit
def _segments_amax_kernel(x_ptr, stride_r, stride_c, table_ptr, amax_bits_ptr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RHT: tl.constexpr,
                          SIGN_MASK: tl.constexpr, VEC2D: tl.constexpr, ROWS16: tl.constexpr,
                          XC16: tl.constexpr, COUNTS: tl.constexpr = False, R_ALL=0, E=0,
                          BLOCK_E: tl.constexpr = 16):
    """Per segment b (grid axis 2), max |x| of the segment into amax_bits_ptr[b] (int32, zeroed), as `_amax_kernel`:
    the grid's first axis strides over the segment's tiles, one atomic per program (the padding adds zeros only)."""
    b = tl.program_id(2)
    if COUNTS:  # segment b: the next counts[b] columns of x (table_ptr holds the counts, R_ALL x's rows)
        xc, CL, _, _ = _count_segment(table_ptr, b, E, BLOCK_E)
        xr, R = 0, R_ALL
    else:
        xr, xc, R, _, _, _, CL = _segment(table_ptr, b, ROWS16, XC16)
    tiles_c = tl.cdiv(CL, BLOCK_C)
    tl.atomic_max(amax_bits_ptr + b, _tiles_amax(x_ptr + xr * stride_r + xc * stride_c, stride_r, stride_c, R, CL,
                                                 tiles_c, tl.cdiv(R, BLOCK_R) * tiles_c, BLOCK_R, BLOCK_C, RHT,
                                                 SIGN_MASK, VEC2D, not XC16))


@triton.jit
def _segments_quant_kernel(x_ptr, stride_r, stride_c, table_ptr, OC, data_ptr, scale_ptr, amax_ptr, gs_ptr,
                           amax_out_ptr, seed_ptr, vals_ptr, sixth,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BR: tl.constexpr,
                           STOCHASTIC: tl.constexpr, RHT: tl.constexpr, WRITE_VALS: tl.constexpr,
                           SIGN_MASK: tl.constexpr, VEC2D: tl.constexpr, ROWS16: tl.constexpr,
                           XC16: tl.constexpr, COUNTS: tl.constexpr = False, R_ALL=0, E=0,
                           BLOCK_E: tl.constexpr = 16):
    """Segment b (grid axis 2) quantised as its own tensor (one global scale, its own seed, stochastic-rounding
    index r * C_b + c inside the segment): the same bits as `_quant_kernel` on that segment alone, zero-padded
    from the columns read to the segment's columns. COUNTS: the segments of `_count_segment`, found per program
    from the counts on the device (`quantize_count_segments_triton`); the tile arithmetic is the same."""
    G: tl.constexpr = BLOCK_C // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    if COUNTS:  # axis 1 runs over every segment's column tiles in turn; the segments come from the counts
        if (pid_r == 0) & (pid_c == 0):  # every segment's scales, empty ones included (they have no tile)
            ei = tl.arange(0, BLOCK_E)
            am = tl.load(amax_ptr + ei, mask=ei < E, other=0.0)
            se, sd = _global_scales(am)
            tl.store(gs_ptr + ei, sd, mask=ei < E)
            tl.store(amax_out_ptr + ei, _decode_amax(am, se), mask=ei < E)
        b, pid_c, xc, CL, C, ocol = _count_tile(table_ptr, pid_c, E, BLOCK_E, BLOCK_C)
        if b >= E:  # past the last segment's tiles (the grid is sized for the most tiles the counts can need)
            return
        xr, R, orow = 0, R_ALL, 0
        if ROWS16:
            R = tl.multiple_of(R, 16)
        amax = tl.load(amax_ptr + b)
        s_enc, s_dec = _global_scales(amax)
    else:
        b = tl.program_id(2)
        xr, xc, R, C, orow, ocol, CL = _segment(table_ptr, b, ROWS16, XC16)
        amax = tl.load(amax_ptr + b)
        s_enc, s_dec = _global_scales(amax)  # an empty segment: amax 0, S_enc 1
        if (pid_r == 0) & (pid_c == 0):
            tl.store(gs_ptr + b, s_dec)
            tl.store(amax_out_ptr + b, _decode_amax(amax, s_enc))
    if (pid_r * BLOCK_R >= R) | (pid_c * BLOCK_C >= C):
        return
    xb = x_ptr + xr * stride_r + xc * stride_c
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mix = tl.load(seed_ptr + b) if STOCHASTIC else 0
    c0 = pid_c * BLOCK_C
    x = _load_tile(xb, stride_r, stride_c, rows, c0, R, CL, BLOCK_R, G, RHT, SIGN_MASK, VEC2D, not XC16)
    _quantize_tile(x, _block_amax(x), rows, c0, R, C, s_enc, s_dec, sixth, mix, data_ptr, scale_ptr, vals_ptr,
                   pid_r, orow, ocol, OC, BLOCK_R, G, BR, STOCHASTIC, WRITE_VALS, VEC2D)


def _outputs(rows: int, cols: int, br: int, values_dtype, dev):
    """Uninitialised codes [rows, cols/2], E4M3 scale bits [rows/br, cols/16] and block values [rows, cols] (the codes
    stand in when no values are written)."""
    data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(rows // br, cols // 16, dtype=torch.uint8, device=dev)
    vals = torch.empty(rows, cols, dtype=values_dtype, device=dev) if values_dtype is not None else data
    return data, scale, vals


def _result(data, scale, gs, amax_out, vals, values_dtype):
    return data, scale.view(torch.float8_e4m3fn), gs, amax_out, vals if values_dtype is not None else None


def _seed_tail(seeds, nseg: int, stochastic: bool) -> np.ndarray:
    """int32 [2 B]: B seed mixes (zeros without stochastic rounding), then B zeroed amax bits, for one copy."""
    tail = np.zeros(2 * nseg, dtype=np.int32)
    if stochastic:
        tail[:nseg] = seed_mixes(seeds)
    return tail


def quantize_segments_triton(x: torch.Tensor, segments, out_shape: tuple[int, int], block=(1, 16),
                             rounding: str = "nearest", seeds=None, rht: bool = False,
                             values_dtype: torch.dtype | None = None, tuning: dict | None = None,
                             amax: torch.Tensor | None = None):
    """Quantise B rectangles of x, each as its own tensor (scale_scope="tensor"), into one output array.

    segments: B tuples (x_row, x_col, rows, cols, out_row, out_col[, read]), or those rows as an int array [B, 7]
    (read given): rows x cols of x starting at (x_row,
    x_col), written at (out_row, out_col) of outputs shaped `out_shape` [R_out, C_out] (codes [R_out, C_out/2], E4M3
    scales [R_out/br, C_out/16], block values [R_out, C_out] if values_dtype). Columns and output columns are
    multiples of 16 (for 16x16 blocks every entry is). x_col is any column for 1x16 blocks. read
    (default cols): only the first `read` <= cols columns come from x, the rest of the segment is zeros (the
    kernels pad it: no padded copy of x). Every rectangle read must lie inside x. seeds: B stochastic-rounding
    seeds. Every segment's bits equal `quantize_with_values_triton` (and the reference) on that rectangle alone,
    zero-padded. Returns (data, scale, global scales fp32 [B], decode amaxes fp32 [B], values or None); output
    positions no segment covers are left uninitialised.
    One amax launch and one quantisation launch for all segments, no host synchronisation. tuning: a TUNING-style
    dict (elems, warps, vec2d) overriding the default tile for x's layout (same bits, speed only). amax: each
    segment's max |x| (fp32 [B], after the RHT when rht) computed by the caller: no amax launch then.
    """
    ensure_interpreter_compat()
    nq._check_values_dtype(values_dtype)
    block = tuple(block)
    br = block[0]
    stochastic = rounding == "stochastic"
    if stochastic and (seeds is None or len(seeds) != len(segments)):
        raise ValueError("stochastic rounding needs one seed per segment")
    if isinstance(segments, np.ndarray):  # a table already (the MoE wgrad builds it with array operations)
        if segments.ndim != 2 or segments.shape[1] != 7 or not np.issubdtype(segments.dtype, np.integer):
            raise ValueError(f"a segment table is an integer array [B, 7], got {segments.dtype} {segments.shape}")
        tab = segments.astype(np.int64, copy=False)
    else:
        segments = [tuple(sg) for sg in segments]
        if any(len(sg) not in (6, 7) for sg in segments):
            raise ValueError("segments are (x_row, x_col, rows, cols, out_row, out_col[, read]) tuples")
        tab = np.asarray([sg if len(sg) == 7 else sg + (sg[3],) for sg in segments], dtype=np.int64).reshape(-1, 7)
    must16 = tab[:, [3, 5]] if br == 1 else tab
    for bad, why in (((must16 % 16).any(axis=1), "columns and output columns (and everything for 16x16 blocks) must "
                                                 "be multiples of 16"),
                     ((tab[:, 6] < 0) | (tab[:, 6] > tab[:, 3]), "the columns read must be between 0 and the "
                                                                "segment's columns"),
                     ((tab[:, 0] + tab[:, 2] > x.shape[0]) | (tab[:, 1] + tab[:, 6] > x.shape[1])
                      | (tab[:, :2] < 0).any(axis=1), f"reads outside x {tuple(x.shape)}")):
        if bad.any():
            raise ValueError(f"segment {tuple(int(v) for v in tab[np.nonzero(bad)[0][0]])}: {why}")
    xc16 = not (tab[:, [1, 6]] % 16).any()  # a compile-time hint (_segment); False: element masks on the loads
    dev = x.device
    out_r, out_c = out_shape
    data, scale, vals = _outputs(out_r, out_c, br, values_dtype, dev)
    nseg = len(tab)
    if nseg == 0:
        empty = torch.empty(0, device=dev)
        return _result(data, scale, empty, empty, vals, values_dtype)
    if amax is not None and amax.shape != (nseg,):
        raise ValueError(f"amax of shape {tuple(amax.shape)} for {nseg} segments")
    max_r, max_c = int(tab[:, 2].max()), int(tab[:, 3].max())
    # one host-to-device copy: the table (int64 [B, 7]), then B seed mixes and B zeroed amax bits (int32 pairs)
    tail = _seed_tail(seeds, nseg, stochastic)
    blob = host_to(torch.from_numpy(np.concatenate([tab.reshape(-1), tail.view(np.int64)])), dev)  # no sync
    table, tail_d = blob[:7 * nseg].view(nseg, 7), blob[7 * nseg:].view(torch.int32)
    mixes, zero_bits = tail_d[:nseg], tail_d[nseg:]
    col_major = nq._col_major(x) and br == 1
    tune = tuning or nq.TUNING["colmajor_segments" if col_major else ("stack" if br == 16 else "values")]
    block_r, block_c, _ = nq._tile_shape(max(max_r, 1), max(max_c, 16), br, False, tune["elems"], col_major,
                                      tune.get("rows", 128))
    warps = nq._warps(tune, block_r, block_c)
    vec2d = tune["vec2d"]
    grid = (cdiv(max(max_r, 1), block_r), cdiv(max(max_c, 16), block_c), nseg)
    rows16 = not (tab[:, [0, 2, 4]] % 16).any()  # a compile-time hint (_segment)
    if amax is None:  # an atomic max per segment of the fp32 bits; the quantisation kernel derives the scales
        bits = zero_bits
        launcher(_segments_amax_kernel)[(nq._amax_programs(dev, grid[0] * grid[1], nseg), 1, nseg)](
                                    x, x.stride(0), x.stride(1), table, bits, BLOCK_R=block_r, BLOCK_C=block_c,
                                    RHT=rht, SIGN_MASK=RHT_SIGN_MASK, VEC2D=vec2d, ROWS16=rows16,
                                    XC16=xc16, num_warps=warps)
        amax = bits.view(torch.float32)
    else:
        amax = amax.to(device=dev, dtype=torch.float32).contiguous()
    gs = torch.empty(nseg, dtype=torch.float32, device=dev)
    amax_out = torch.empty(nseg, dtype=torch.float32, device=dev)
    launcher(_segments_quant_kernel)[grid](
        x, x.stride(0), x.stride(1), table, out_c, data, scale, amax, gs, amax_out, mixes, vals, SIXTH, BLOCK_R=block_r,
        BLOCK_C=block_c, BR=br, STOCHASTIC=stochastic, RHT=rht, WRITE_VALS=values_dtype is not None,
        SIGN_MASK=RHT_SIGN_MASK, VEC2D=vec2d, ROWS16=rows16, XC16=xc16, num_warps=warps)
    return _result(data, scale, gs, amax_out, vals, values_dtype)


def count_segments_columns(total: int, experts: int) -> int:
    """Output columns of `quantize_count_segments_triton` for `total` columns of x in `experts` segments: the most
    that the padded counts can sum to (each count padded by at most 15), so that the counts never leave the device."""
    return cdiv(total + 15 * experts, 16) * 16


def quantize_count_segments_triton(x: torch.Tensor, counts: torch.Tensor, rounding: str = "nearest", seeds=None,
                                   rht: bool = False, values_dtype: torch.dtype | None = None,
                                   tuning: dict | None = None):
    """`quantize_segments_triton` for the MoE wgrad's column segments given by device counts: segment e is the next
    counts[e] columns of x [R, T] (the tokens of expert e), zero-padded to a multiple of 16 columns and written
    after the segments before it, with no host synchronisation (the counts stay on the device; every program finds
    its segment from them). Each segment's bits are those of the table launch on the same segments. The outputs
    have `count_segments_columns(T, E)` columns, of which the padded counts' sum are written (the rest is left
    uninitialised). The counts are trusted: they must be E non-negative integers summing to T (as a router's are),
    which cannot be checked without reading them. Returns (data, scale, global scales fp32 [E], decode amaxes fp32
    [E], values or None)."""
    ensure_interpreter_compat()
    nq._check_values_dtype(values_dtype)
    if x.dim() != 2 or counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"count segments need x [R, T] and integer counts [E], got x {tuple(x.shape)}, counts "
                         f"{counts.dtype} {tuple(counts.shape)}")
    nseg = counts.numel()
    stochastic = rounding == "stochastic"
    if stochastic and (seeds is None or len(seeds) != nseg):
        raise ValueError("stochastic rounding needs one seed per segment")
    dev = x.device
    rows, total = x.shape
    out_c = count_segments_columns(total, nseg)
    data, scale, vals = _outputs(rows, out_c, 1, values_dtype, dev)
    if nseg == 0:
        empty = torch.empty(0, device=dev)
        return _result(data, scale, empty, empty, vals, values_dtype)
    cnt = counts.to(device=dev, dtype=torch.int32).contiguous()
    if stochastic:  # one host-to-device copy: the seed mixes, then the zeroed amax bits
        tail_d = host_to(torch.from_numpy(_seed_tail(seeds, nseg, True)), dev)
        mixes, bits = tail_d[:nseg], tail_d[nseg:]
    else:  # no seeds to copy: the zeroed amax bits alone (a fill, cheaper on the host than a pinned copy)
        mixes = bits = torch.zeros(nseg, dtype=torch.int32, device=dev)  # mixes: never read without STOCHASTIC
    col_major = nq._col_major(x)
    tune = tuning or nq.TUNING["colmajor_segments" if col_major else "values"]
    # the tile for the widest segment the counts allow (at least 64 columns: the tiles of a table launch whose widest
    # segment is that wide); the bits do not depend on it
    block_r, block_c, _ = nq._tile_shape(max(rows, 1), max(total, 16), 1, False, tune["elems"], col_major,
                                      tune.get("rows", 128))
    warps = nq._warps(tune, block_r, block_c)
    vec2d = tune["vec2d"]
    tiles_r = cdiv(max(rows, 1), block_r)
    tiles_c = cdiv(out_c, block_c) + nseg  # each segment's tiles: its padded width / BLOCK_C, plus one at most
    block_e = max(16, next_power_of_2(nseg))
    rows16 = rows % 16 == 0
    common = dict(COUNTS=True, R_ALL=rows, E=nseg, BLOCK_E=block_e, BLOCK_R=block_r, BLOCK_C=block_c, RHT=rht,
                  SIGN_MASK=RHT_SIGN_MASK, VEC2D=vec2d, ROWS16=rows16, XC16=False, num_warps=warps)
    amax_grid = (nq._amax_programs(dev, tiles_r * cdiv(max(total, 1), block_c * nseg), nseg), 1, nseg)
    launcher(_segments_amax_kernel)[amax_grid](x, x.stride(0), x.stride(1), cnt, bits, **common)
    amax = bits.view(torch.float32)
    gs = torch.empty(nseg, dtype=torch.float32, device=dev)
    amax_out = torch.empty(nseg, dtype=torch.float32, device=dev)
    launcher(_segments_quant_kernel)[(tiles_r, tiles_c, 1)](
        x, x.stride(0), x.stride(1), cnt, out_c, data, scale, amax, gs, amax_out, mixes, vals, SIXTH, BR=1,
        STOCHASTIC=stochastic, WRITE_VALS=values_dtype is not None, **common)
    return _result(data, scale, gs, amax_out, vals, values_dtype)
