"""The MoE wgrad on the kernels: the K-grouped W4A4 GEMM (K = tokens, grouped by expert), its column-segment form
and its multi-pass form (several micro-batches' wgrads in one launch).

out[e] = a[:, K range of e] @ b[:, K range of e]^T, both operands quantised along the tokens (1x16 blocks, one decode
amax per expert segment), each expert's K range a multiple of 16 tokens; the product of block values is exact and
summed in a fixed, sequential K order from a zero accumulator (kernels/nvfp4_gemm.py has the operand decoding and the
exactness argument), then scaled by the segments' amaxes in fp32 (docs/nvfp4.md, "GEMM").

Gradient accumulation: with `accumulate` the fp32 product is rounded and then added to a gradient buffer in place
(Megatron's main_grad), as if written and added afterwards. The multi-pass kernel adds the products of P wgrads of the
same experts (micro-batches) in pass order to the output tile held in registers: bitwise P accumulating launches,
with the buffer read and written once instead of P times. On the H200 the per-micro-batch wgrad of 128 experts is
bound by that fp32 read-modify-write (8 B per weight element), not by its short K (docs/benchmarks.md, issue 17).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from minite.nvfp4.device_copy import int32_to
from minite.nvfp4.grouped import NVFP4Segments, check_accumulate
from minite.nvfp4.tensor import FACTOR_INV, NVFP4Tensor

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher
from .nvfp4_gemm import PTX_DECODE, GemmConfig, _cast_out, _operand_tile, _unshift
from .nvfp4_values import block_values_triton


@triton.jit
def _add_rn(x, y, PTX: tl.constexpr):
    """x + y in fp32, rounded once: PTX's add.rn, which the compiler may not contract with the multiply that made x
    into an FMA (a plain add may be; the interpreter, numpy, never contracts)."""
    if PTX:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return x + y


@triton.jit
def _kgrouped_gemm_kernel(a_data, a_scale, a_vals, a_amax, a_amax_stride, a_amax_stride_e,
                          b_data, b_scale, b_vals, b_amax, b_amax_stride, b_amax_stride_e,
                          c_ptr, k_start_ptr, k_count_ptr, M, N, KT, factor_inv,
                          A_PACKED: tl.constexpr, B_PACKED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PTX: tl.constexpr = False, ACCUMULATE: tl.constexpr = False, PASSES: tl.constexpr = 1,
                          a_amax_stride_s=0, b_amax_stride_s=0, C_ZERO: tl.constexpr = False):
    """c[e] = a[:, K range of e] @ b[:, K range of e]^T (the MoE wgrad: K = tokens, grouped by expert).
    ACCUMULATE: c[e] += that instead (c fp32: a gradient accumulated in place, as Megatron's main_grad), with the
    product rounded to fp32 before the add, as when it is added afterwards (`_add_rn`). C_ZERO (with ACCUMULATE):
    c holds +0.0 everywhere (a gradient buffer just zeroed) and is not read: the product is added to a +0.0 in
    registers, the same bits (a -0.0 product becomes +0.0 either way), 4 bytes per element not read.
    PASSES > 1 (with ACCUMULATE): the K ranges of PASSES wgrads of the same experts (micro-batches), tables [PASSES, E]
    of starts, counts and (with the amax strides _s) segment amaxes; each pass's product is formed from a zero
    accumulator, rounded and added in pass order to the tile of c held in registers: bitwise PASSES launches with
    ACCUMULATE, with c read and written once instead of PASSES times."""
    e = tl.program_id(1)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pm = pid // num_n
    pn = pid % num_n
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    if PASSES == 1:
        out = _kgrouped_pass(a_data, a_scale, a_vals, a_amax, a_amax_stride, a_amax_stride_e,
                             b_data, b_scale, b_vals, b_amax, b_amax_stride, b_amax_stride_e,
                             k_start_ptr + e, k_count_ptr + e, e, rows, rmask, cols, cmask, KT, factor_inv,
                             A_PACKED, B_PACKED, BLOCK_M, BLOCK_N, BLOCK_K, PTX)
        # the output's addresses formed after the K loop: held across it they cost registers (and spills)
        c_ptrs = c_ptr + e.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        if ACCUMULATE:
            if C_ZERO:
                out = _add_rn(out, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PTX)
            else:
                out = _add_rn(out, tl.load(c_ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0), PTX)
    else:
        experts = tl.num_programs(1)
        c_ptrs = c_ptr + e.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        if C_ZERO:
            out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            out = tl.load(c_ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
        for s in range(PASSES):
            part = _kgrouped_pass(a_data, a_scale, a_vals, a_amax + s * a_amax_stride_s, a_amax_stride,
                                  a_amax_stride_e, b_data, b_scale, b_vals, b_amax + s * b_amax_stride_s,
                                  b_amax_stride, b_amax_stride_e, k_start_ptr + s * experts + e,
                                  k_count_ptr + s * experts + e, e, rows, rmask, cols, cmask, KT, factor_inv,
                                  A_PACKED, B_PACKED, BLOCK_M, BLOCK_N, BLOCK_K, PTX)
            out = _add_rn(part, out, PTX)
    tl.store(c_ptrs, _cast_out(out, c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _kgrouped_pass(a_data, a_scale, a_vals, a_amax, a_amax_stride, a_amax_stride_e,
                   b_data, b_scale, b_vals, b_amax, b_amax_stride, b_amax_stride_e,
                   k_start_ptr, k_count_ptr, e, rows, rmask, cols, cmask, KT, factor_inv,
                   A_PACKED: tl.constexpr, B_PACKED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    """One expert's product over its K range (*k_start_ptr, + *k_count_ptr), scaled by its segment amaxes: fp32."""
    # token counts are multiples of 16 (checked by the launcher); a start summed here from the counts (tl.sum) loses
    # the hint and the operand loads turn into 2-byte loads (sass_census.py --wgrad; 2199bda, reverted)
    ks = tl.multiple_of(tl.load(k_start_ptr), 16)
    ke = tl.multiple_of(ks + tl.load(k_count_ptr), 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(ks, ke, BLOCK_K):  # fixed, sequential K order
        a = _operand_tile(a_data, a_scale, a_vals, rows, rmask, k0, ke, KT // 2, KT // 16, KT, 1, A_PACKED,
                          BLOCK_M, BLOCK_K, PTX)
        b = _operand_tile(b_data, b_scale, b_vals, cols, cmask, k0, ke, KT // 2, KT // 16, KT, 1, B_PACKED,
                          BLOCK_N, BLOCK_K, PTX)
        acc = tl.dot(a, tl.trans(b), acc)
    acc = _unshift(acc, A_PACKED, B_PACKED)
    ama = tl.load(a_amax + e * a_amax_stride_e + rows * a_amax_stride, mask=rmask, other=0.0)
    amb = tl.load(b_amax + e * b_amax_stride_e + cols * b_amax_stride, mask=cmask, other=0.0)
    return acc * ((ama[:, None] * amb[None, :]) * factor_inv)


def kgrouped_gemm_triton(a: NVFP4Tensor, b: NVFP4Tensor, tokens_per_expert, out_dtype=torch.float32, *,
                         a_values=None, b_values=None, config: GemmConfig | None = None,
                         a_expert_amax: torch.Tensor | None = None,
                         b_expert_amax: torch.Tensor | None = None,
                         accumulate: torch.Tensor | None = None, zeroed: bool = False) -> torch.Tensor:
    """MoE wgrad: out[e] = a[:, T_e] @ b[:, T_e]^T for a [M, T], b [N, T] quantised along T (tokens grouped by expert).

    Each expert's token count must be a multiple of 16 (pad the permuted tokens per expert): a 16-element block must
    not straddle two experts. a_expert_amax / b_expert_amax: fp32 [E] decode amaxes, one per expert segment, used
    instead of the operands' own (minite.nvfp4.NVFP4Segments). Returns [E, M, N] in out_dtype.
    accumulate: an fp32 [E, M, N] contiguous tensor that the products are added to in place (bitwise its value plus
    the fp32 result), returned instead (out_dtype is then not used). zeroed: accumulate holds +0.0 everywhere (the
    caller's promise, e.g. a gradient buffer zeroed since and not added to): it is written, not read (same bits).
    """
    ensure_interpreter_compat()
    m, kt = a.shape
    n, kt_b = b.shape
    if kt != kt_b:
        raise ValueError(f"token dim mismatch: a {a.shape}, b {b.shape}")
    if a.block[0] != 1 or b.block[0] != 1:
        raise ValueError("wgrad operands use (1, 16) blocks along the token dim")
    dev = a.data.device
    if not torch.is_tensor(tokens_per_expert) or not tokens_per_expert.is_cuda:  # checkable without a sync
        host = np.asarray(tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else tokens_per_expert,
                          dtype=np.int64).reshape(-1)
        if (host % 16).any():
            raise ValueError(f"wgrad token counts must be multiples of 16 (pad per expert), got {host.tolist()}")
        both = int32_to(np.stack([host, np.cumsum(host) - host]), dev)  # counts and starts: one copy, no launch
        counts, starts = both[0], both[1]
    else:
        counts = tokens_per_expert.to(torch.int32)
        starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
    experts = counts.numel()
    # 128x256x64, 3 stages: the expert block's FC2 wgrad on the H200 in 859 us (2026-12-01, f42a446) and 845 us
    # (4e12937) against 1002 and 1010 us for 128x128x64 (bench_nvfp4.py --sections block, wgrad_fc2*); the tile does
    # not change the order of the K (token) loop
    cfg = config or (GemmConfig(16, 32, 64, 4, 1) if interpreting() else GemmConfig(128, 256, 64, 8, 3))
    if accumulate is not None:
        check_accumulate(accumulate, (experts, m, n), dev, "kgrouped_gemm")
    out = torch.empty(experts, m, n, dtype=out_dtype, device=dev) if accumulate is None else accumulate
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), experts)
    a_am, a_rs, a_es = ((a.decode_amax(), 1 if a.per_row else 0, 0) if a_expert_amax is None
                        else (a_expert_amax, 0, 1))
    b_am, b_rs, b_es = ((b.decode_amax(), 1 if b.per_row else 0, 0) if b_expert_amax is None
                        else (b_expert_amax, 0, 1))
    launcher(_kgrouped_gemm_kernel)[grid](
        a.data, a.scale.view(torch.uint8), a.data if a_values is None else a_values, a_am, a_rs, a_es,
        b.data, b.scale.view(torch.uint8), b.data if b_values is None else b_values, b_am, b_rs, b_es,
        out, starts, counts, m, n, kt, FACTOR_INV,
        A_PACKED=a_values is None, B_PACKED=b_values is None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PTX=PTX_DECODE and not interpreting(),
        ACCUMULATE=accumulate is not None, C_ZERO=accumulate is not None and zeroed, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


# The multi-pass wgrad keeps the output tile in registers beside the accumulator: 64 x 256 on 8 warps holds both in
# 128 fp32 registers per thread with no local memory (sm_90, Triton 3.6, sass_census.py --wgrad: 128 x 256 needs 256
# and 128 x 128 on 8 warps spilled 66 loads and stores; the one-pass accumulate tile 128 x 256 spills 242 in its
# epilogue). 4 stages: the slice's 8-micro-batch flush of FC1 / FC2 in 9.26 / 5.21 ms against 9.64 / 5.33 with 3,
# 11.76 / 6.30 for BLOCK_K 128 (bench_wgrad.py, H200, 2026-12-04, 1a5e221; docs/benchmarks.md)
PASSES_TILE = GemmConfig(64, 256, 64, 8, 4)


def _segment_table(passes: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, E] int32 starts and widths of P segment operands laid side by side along the columns (pass p's columns
    start where pass p - 1's end): device widths stay on the device, host widths travel in one copy."""
    offsets = np.cumsum([0] + [2 * p.data.shape[1] for p in passes[:-1]])
    if all(torch.is_tensor(p.widths) for p in passes):
        widths = torch.stack([p.widths.to(device=device, dtype=torch.int32) for p in passes])
        starts = torch.cumsum(widths, 1, dtype=torch.int32) - widths
        # the offsets are host integers: a pinned, asynchronous copy (a pageable `.to(device)` is a stream
        # synchronisation: 32 in an 8-micro-batch step of the 4-layer slice, H100 profile, 2026-12-05)
        return (starts + int32_to(offsets, device)[:, None]).to(torch.int32), widths
    host = np.asarray([p.host_widths for p in passes], dtype=np.int64)
    both = int32_to(np.stack([np.cumsum(host, 1) - host + offsets[:, None], host]), device)
    return both[0], both[1]


def segmented_gemm_passes_triton(a: list, b: list, accumulate: torch.Tensor, zeroed: bool = False) -> torch.Tensor:
    """accumulate[e] += a[p]_e @ b[p]_e^T for p = 0, 1, ... in order (the wgrads of several micro-batches, one launch):
    bitwise `segmented_gemm_triton(a[p], b[p], accumulate=accumulate)` for each p in turn. The passes' packed codes
    are laid side by side and their fp16 block values written in one launch per operand (bitwise those the quantiser
    writes, minite.kernels.nvfp4_values); accumulate is read and written once (written only when `zeroed`: it
    holds +0.0 everywhere, the caller's promise)."""
    ensure_interpreter_compat()
    dev = a[0].data.device
    experts, ra, rb = len(a[0].widths), a[0].data.shape[0], b[0].data.shape[0]
    check_accumulate(accumulate, (experts, ra, rb), dev, "segmented_gemm_passes")
    starts, widths = _segment_table(a, dev)  # b's segments are those of the same counts (segmented_gemm_passes)
    operands = []
    for side in (a, b):
        data, scale = torch.cat([p.data for p in side], 1), torch.cat([p.scale for p in side], 1)
        operands.append((data, scale, block_values_triton(data, scale), torch.stack([p.amax.float() for p in side])))
    (ad, asc, av, aam), (bd, bsc, bv, bam) = operands
    kt = 2 * ad.shape[1]
    cfg = GemmConfig(16, 32, 64, 4, 1) if interpreting() else PASSES_TILE
    grid = (cdiv(ra, cfg.block_m) * cdiv(rb, cfg.block_n), experts)
    launcher(_kgrouped_gemm_kernel)[grid](
        ad, asc.view(torch.uint8), av, aam, 0, 1, bd, bsc.view(torch.uint8), bv, bam, 0, 1,
        accumulate, starts, widths, ra, rb, kt, FACTOR_INV, A_PACKED=False, B_PACKED=False,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PTX=PTX_DECODE and not interpreting(),
        ACCUMULATE=True, PASSES=len(a), a_amax_stride_s=experts, b_amax_stride_s=experts, C_ZERO=zeroed,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return accumulate


def segmented_gemm_triton(a: NVFP4Segments, b: NVFP4Segments, out_dtype=torch.float32,
                          accumulate: torch.Tensor | None = None, zeroed: bool = False) -> torch.Tensor:
    """out[e] = a_e @ b_e^T over matching column segments (minite.nvfp4.segmented_gemm): the K-grouped kernel with
    one decode amax per segment; reads the fp16 block values when both operands carry them."""
    ra, rb, total = a.data.shape[0], b.data.shape[0], 2 * a.data.shape[1]  # device widths: an upper bound
    one = torch.ones((), dtype=torch.float32, device=a.data.device)
    if a.amax is None or b.amax is None:
        raise ValueError("segmented_gemm: NVFP4Segments without amax; build them with quantize_column_segments")
    qa = NVFP4Tensor(a.data, a.scale, one, (ra, total), (1, 16), amax=one)
    qb = NVFP4Tensor(b.data, b.scale, one, (rb, total), (1, 16), amax=one)
    use_vals = a.values is not None and b.values is not None
    widths = a.widths if torch.is_tensor(a.widths) else list(a.widths)
    return kgrouped_gemm_triton(qa, qb, widths, out_dtype, a_values=a.values if use_vals else None,
                                b_values=b.values if use_vals else None, a_expert_amax=a.amax,
                                b_expert_amax=b.amax, accumulate=accumulate, zeroed=zeroed)
