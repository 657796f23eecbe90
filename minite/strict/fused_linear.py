"""`ops.linear`'s fp32 path (`ops._linear_fwd`) in one Triton kernel: the same products, the same tree over K.

`ops._linear_fwd` computes y[m, n] = tree_sum over k of fl(x[m, k] * w[n, k]) in fp32 (products rounded once, sums
by adjacent pairs after zero padding K to a power of two) and materialises the [rows, columns, K] products to do it:
the strict router (K = hidden 2048, N = 128 experts) writes and re-reads 64 x 128 x 2048 fp32 products per layer at
batch 64, and its tree sums were the largest strict-only kernel of a decode step (docs/benchmarks.md). Here one
program holds one row of x and BLOCK_N rows of w, multiplies them in registers (fp32, no FMA contraction: the
launch passes enable_fp_fusion=False) and sums each product row with `fused._pair_tree`, the adjacent-pair tree of
`ops.tree_sum`, over the padded width: the same IEEE operations in the same order, so the same bits. The products
past K are 0 * 0 = +0, as the padding's zeros. Rows of K up to `fused.MAX_WIDTH` (the router's); wider ones, and outputs
wider than the grid takes, stay on the torch ops (`ops._linear_fwd` asks `applies` and `fused.routes` with "linear").
"""
from __future__ import annotations

import torch

from minite.kernels._interpreter import ensure_interpreter_compat
from minite.kernels._launch import cdiv, launcher, next_power_of_2

from . import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep CPU imports cheap and safe
    triton = None

BLOCK_ELEMS = 8192
"""Products one program holds (BLOCK_N rows of the padded width): 4 output columns at K = 2048."""
LINEAR_WARPS = 4
"""Warps per program (any count computes the same bits: the sums are an explicit pair tree)."""
MAX_COLUMN_BLOCKS = 65535
"""CUDA's limit on the grid's second axis (the column blocks); wider outputs stay on the torch ops (`applies`)."""


MIN_PROGRAMS = 1024
"""Rows share a program (`_rows`) only while the launch keeps at least this many programs (~8 a SM on the H200)."""


def _block_n(n: int, width: int) -> int:
    return max(1, min(next_power_of_2(n), BLOCK_ELEMS // width))


def _rows(m: int, column_blocks: int) -> int:
    """Rows a program computes with one load of its weight block: 1, 2, 4 or 8 (at most m), as many as keep
    MIN_PROGRAMS programs. One row a program re-read the router's whole weight (1 MiB in fp32) for every row: at
    batch 256 the strict router took 112 us a layer on an H100 (docs/benchmarks.md, the thirty-second session). Each
    row's products and tree are the same operations either way, so the bits are too."""
    rows = 1
    while rows < 8 and 2 * rows <= m and cdiv(m, 2 * rows) * column_blocks >= MIN_PROGRAMS:
        rows *= 2
    return rows


def applies(n: int, k: int) -> bool:
    """Whether `linear` takes an output of n columns over K = k (`ops._linear_fwd` routes only then)."""
    if triton is None or k > fused.MAX_WIDTH:
        return False
    return k == 0 or cdiv(n, _block_n(n, 1 << (k - 1).bit_length())) <= MAX_COLUMN_BLOCKS


if triton is not None:
    @triton.jit(do_not_specialize=["m", "n", "k"])
    def _linear_kernel(x_ptr, w_ptr, y_ptr, m, n, k, sxm, swn, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
                       LEVELS: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr):
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, WIDTH)
        w = fused._load_f32(w_ptr, cols[:, None].to(tl.int64) * swn + kk[None, :],
                            (cols < n)[:, None] & (kk < k)[None, :])
        for r in range(ROWS):  # the weight block loaded once for ROWS rows; each row's operations as alone
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            x = fused._load_f32(x_ptr, row * sxm + kk, (kk < k) & (kk * 0 + row < m))  # masks as tensors
            y = fused._pair_tree(x[None, :] * w, LEVELS, SPLIT)
            tl.store(y_ptr + row * n + cols, y, mask=(cols < n) & (cols * 0 + row < m))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`ops._linear_fwd(x, w)`'s bits: [M, K] x [N, K] -> fp32 [M, N], x and w in fp32, bf16 or fp16."""
    if not fused.available(x) or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"strict fused linear needs [M, K] x [N, K] floating CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got {tuple(x.shape)} x {tuple(w.shape)}")
    if x.dtype == torch.float64 or w.dtype == torch.float64:
        raise ValueError("strict fused linear: float64 operands (ops._linear_fwd would round them to fp32 first)")
    m, k = x.shape
    n = w.shape[0]
    if not applies(n, k):
        raise ValueError(f"strict fused linear: K = {k} (at most {fused.MAX_WIDTH}) over {n} columns does not apply")
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    ensure_interpreter_compat()
    xc, wc = x.contiguous(), w.contiguous()
    width = 1 << (k - 1).bit_length()  # k == 1: width 1, no addition (as ops.tree_sum)
    block_n = _block_n(n, width)
    rows = _rows(m, cdiv(n, block_n))
    launcher(_linear_kernel)[(cdiv(m, rows), cdiv(n, block_n))](
        xc, wc, out, m, n, k, xc.stride(0), wc.stride(0), BLOCK_N=block_n, WIDTH=width, LEVELS=width.bit_length() - 1,
        SPLIT=fused.pair_split(), ROWS=rows, num_warps=LINEAR_WARPS, enable_fp_fusion=False)
    return out
