"""Strict-mode BF16 GEMM on CUDA: one Triton kernel, K reduced in a fixed order whatever its tile.

y[m, n] = sum over K blocks k0 = 0, 64, 128, ... (in that order) of tl.dot(x[m, k0:k0+64], w[n, k0:k0+64]) in fp32.
No autotuning, no split-K, no atomics: every output element is one sequential chain of MMAs over K in blocks of
BLOCK_K, whatever M is and whatever the tile: the program that holds row m differs between a decode step (M = batch)
and a full forward (M = B*T), the arithmetic does not. docs/nvfp4.md records this, measured on the H200 (a
sequential-K Triton bf16 matmul gave bitwise identical rows for M = 1, 7, 512 and for every tile shape tried); the
launch picks its tile by shape (`TILES`, `tile`: a decode batch's lm_head takes a larger tile than its QKV), which is
safe only because of that: tools/bench/sweep_fixed_k.py compared every tile of TILES bit for bit with the 64x64 tile
at ten shapes on an H100, and tests/alignment/test_strict_alignment_gpu.py checks rows at M = 1..512 and each tile.

Why not the CPU strict GEMM on the GPU: `strict_ops.linear` materialises [M, N, K] products; at decode sizes it
was 4.8x slower than cuBLAS per step on the H200 (docs/alignment.md), while a fixed-order tensor-core kernel costs
about what a GEMM costs. The guarantee differs in kind: strict_ops is batch invariant by IEEE-754 rules alone; this
kernel by a fixed instruction sequence (deterministic hardware), verified bitwise on the device.
Inputs must be bf16 or fp16 (fp32 operands would go through TF32 or a slow IEEE path; strict mode keeps fp32
GEMMs, e.g. the router's, on strict_ops).

`grouped_matmul_fixed_k`: the MoE experts' GEMMs (rows grouped by expert, one weight per expert) in one launch, each
tile holding rows of one expert only and computing them with the same configuration and K order, so every row is
bitwise what `matmul_fixed_k` gives on that expert's rows alone. The counts stay on the device (every program finds
its expert from them, no host synchronisation): a strict BF16 decode step can be captured in a CUDA graph, which the
per-expert loop, reading the counts on the host, could not.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from minite.kernels._interpreter import interpreting
from minite.kernels._launch import cdiv, launcher, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep CPU imports cheap and safe
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 64, 4  # the grouped kernel's tile; BLOCK_K is every launch's K order


class Tile(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int


TILES = (Tile(64, 64, 4, 3), Tile(128, 128, 8, 3), Tile(128, 256, 8, 4))
"""`matmul_fixed_k`'s tiles, smallest first (`tile` picks one). Every tile keeps BLOCK_K, so the K order, and a row's
bits do not depend on it (module docstring; tests/alignment/test_strict_alignment_gpu.py checks each tile on the GPU).
Measured on one H100 (2026-12-06, tools/bench/sweep_fixed_k.py, docs/benchmarks/fixed-k-sweep-h100.json), every
tile swept bitwise the 64x64 tile's at every shape: the lm_head (N 151936, K 2048) at 256 rows 357.1 us on 128x256
against 556.2 on 64x64 (cuBLAS 278.8), at 2048 rows 2385.0 against 4200.6 (cuBLAS 1937.7); at 1 and 64 rows 64x64 is
the fastest. A large tile that leaves fewer programs than about one wave of the GPU's SMs is slower: the QKV (N
5120, K 2048) at 256 rows 26.7 us on 128x256 (40 programs) against 17.6 on 64x64, the output projection (N 2048, K
4096) at 256 rows 47.4 against 16.0; at 1024 rows 128x128 is the fastest there (40.0 against 53.3 on 64x64)."""
MIN_PROGRAMS = 128
"""A tile larger than the first is taken only where its grid holds this many programs (about one wave of an H100's
or H200's 132 SMs; the sweep's ten shapes pick their fastest tile, or one within 3%, by it) and it has no more rows
than the launch."""


def tile(m: int, n: int) -> Tile:
    """The tile of a `matmul_fixed_k` launch of [m, K] x [n, K]^T: the largest of TILES that fills the GPU
    (MIN_PROGRAMS), else the first."""
    for t in reversed(TILES[1:]):
        if m >= t.block_m and cdiv(m, t.block_m) * cdiv(n, t.block_n) >= MIN_PROGRAMS:
            return t
    return TILES[0]


if triton is not None:
    @triton.jit
    def _fixed_k_matmul(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        # 64-bit row offsets: [M, N] outputs reach 2^31 elements (the lm_head's 151,936 columns at 14,134 rows)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, acc,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


    @triton.jit
    def _grouped_fixed_k_matmul(x_ptr, w_ptr, y_ptr, count_ptr, E, N, K, sxm, sxk, swe, swn, swk, sym, syn,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr):
        """Tile t of the experts' tiles in order (each expert's rows in BM-row tiles, its last one masked), columns
        pid_n: `_fixed_k_matmul`'s body on expert e's rows and weight. Programs past the last tile return."""
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        ei = tl.arange(0, BLOCK_E)
        cnt = tl.load(count_ptr + ei, mask=ei < E, other=0).to(tl.int32)
        tiles = (cnt + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        e = tl.sum((tile_end <= t).to(tl.int32), 0)  # experts whose tiles all come before tile t
        if e >= E:
            return
        sel = ei == e
        local = t - tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        end = tl.sum(tl.where(sel, tl.cumsum(cnt, 0), 0), 0)
        start = end - tl.sum(tl.where(sel, cnt, 0), 0)
        rm = start + local * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        wp = w_ptr + e.to(tl.int64) * swe
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < end) & (kk[None, :] < K), other=0.0)
            b = tl.load(wp + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, acc,
                 mask=(rm[:, None] < end) & (rn[None, :] < N))


def available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the fixed-K Triton GEMM applies: CUDA tensors, bf16/fp16 operands of one dtype, 2-D."""
    return (triton is not None and x.is_cuda and w.is_cuda and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and w.dim() == 2)


def matmul_fixed_k(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [N, K]^T -> fp32 [M, N] with the fixed configuration above (see the module docstring)."""
    if not available(x, w):
        raise ValueError("matmul_fixed_k needs 2-D CUDA bf16/fp16 operands of one dtype")
    return _fixed_k(x, w)


def _fixed_k(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The launch of `matmul_fixed_k` (also under the interpreter: the CPU tests' reference for the grouped one)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    t = tile(m, n)
    grid = (cdiv(m, t.block_m), cdiv(n, t.block_n))
    launcher(_fixed_k_matmul)[grid](
        x, w, y, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1), BM=t.block_m,
        BN=t.block_n, BK=BLOCK_K, num_warps=t.warps, num_stages=t.stages)
    return y


def grouped_available(x: torch.Tensor, w: torch.Tensor, counts) -> bool:
    """True when `grouped_matmul_fixed_k` applies: `available` for x and one expert's weight of w [E, N, K], and the
    counts a tensor on x's device."""
    return (w.dim() == 3 and available(x, w[0]) and torch.is_tensor(counts) and counts.device == x.device
            and counts.dim() == 1 and counts.numel() == w.shape[0])


def grouped_matmul_fixed_k(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows x [R, K] grouped by expert (counts [E] on the device, trusted to sum to R: checking them would read them
    back) times each expert's w [E, N, K]^T -> fp32 [R, N]; row for row `matmul_fixed_k(x_e, w[e])` (module
    docstring). Under Triton's interpreter (TRITON_INTERPRET=1) CPU tensors run too: the CPU tests' comparison."""
    if not (grouped_available(x, w, counts) or (interpreting() and w.dim() == 3 and x.dim() == 2)):
        raise ValueError("grouped_matmul_fixed_k needs 2-D CUDA bf16/fp16 rows, [E, N, K] weights of the same dtype "
                         "and E counts on the rows' device")
    (r, k), (experts, n, _) = x.shape, w.shape
    y = torch.empty(r, n, dtype=torch.float32, device=x.device)
    if r == 0 or n == 0:
        return y
    cnt = counts if counts.dtype == torch.int32 else counts.to(torch.int32)
    grid = (cdiv(r, BLOCK_M) + experts, cdiv(n, BLOCK_N))  # each expert adds at most one partial tile
    launcher(_grouped_fixed_k_matmul)[grid](
        x, w, y, cnt, experts, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        y.stride(1), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, BLOCK_E=max(16, next_power_of_2(experts)), num_warps=NUM_WARPS)
    return y

