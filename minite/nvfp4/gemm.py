"""NVFP4 x NVFP4 GEMMs, the reference: exact block products, then Transformer Engine's alpha from the two amaxes.

out = a @ b^T for a [M, K] and b [N, K], both quantised along K:
    acc[m, n]   = sum_k block_values(a)[m, k] * block_values(b)[n, k]
    alpha[m, n] = (amax_a[m] * amax_b[n]) * fl(1/(6*6*448*448))   (fp32, TE's per-tensor-scale kernel with alpha_in = 1;
                                                                    a per-tensor amax broadcasts)
    out[m, n]   = fp32(acc[m, n]) * alpha[m, n]                   (fp32, then cast to out_dtype)
With per-row activation amaxes, alpha[m, n] is TE's per-tensor formula applied to row m's amax (TE's row-scaled
reference does the same): row m's output depends on row m alone, so the GEMM stays batch invariant (docs/nvfp4.md).
The reference accumulates in float64: every product of two block values is exact there (<= 12 significant bits), and
the sum of K of them is exact whenever they span fewer than 53 bits, which always holds for K <= 1024 (products are
multiples of 2^-20 below 2^23) and beyond that unless one row mixes products ~2^(53 - log2 K) apart. The fp32 result
is then one rounding of the exact sum, independent of summation order and batch size; a kernel with fp32 accumulation
differs from it by fp32 summation error only (see tests/tolerances.py).
"""
from __future__ import annotations

import torch

from .backend import kernel, resolve
from .tensor import BLOCK_2D, FACTOR_INV, NVFP4Tensor


def _alpha(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
    """(amax_a[m] * amax_b[n]) * FACTOR_INV in fp32, shaped to broadcast over [M, N]."""
    ga = a.decode_amax()[:, None] if a.per_row else a.decode_amax()
    gb = b.decode_amax()[None, :] if b.per_row else b.decode_amax()
    return (ga * gb) * FACTOR_INV


def _check_pair(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm: K mismatch, a is {a.shape} and b is {b.shape} (computes a @ b^T)")


def gemm_reference(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _check_pair(a, b)
    acc = (a.block_values(torch.float64) @ b.block_values(torch.float64).t()).to(torch.float32)
    return (acc * _alpha(a, b)).to(out_dtype)


def gemm(a: NVFP4Tensor, b: NVFP4Tensor, *, out_dtype: torch.dtype = torch.float32,
         backend: str = "auto", transpose_b: bool = False) -> torch.Tensor:
    """a @ b^T with NVFP4 operands, [M, K] x [N, K] -> [M, N] in out_dtype.

    transpose_b: a @ b instead, [M, N] x [N, K] -> [M, K], with b^T the exact transpose of a 16x16-block b (a
    linear's dgrad). The kernels read b's block values transposed in place, so no transposed copy of b is made
    (`NVFP4Tensor.t()`, cached on b, is what the reference and a b without block values use)."""
    if transpose_b:
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"gemm: K mismatch, a is {a.shape} and b is {b.shape} (transpose_b: computes a @ b)")
        if b.block != BLOCK_2D or b.per_row:
            raise ValueError(f"gemm: transpose_b needs b with (16, 16) blocks and one global scale (an exact "
                             f"transpose), got block={b.block}, per_row={b.per_row}")
    else:
        _check_pair(a, b)
    name, _ = resolve(backend, a.data, op="gemm")
    if name == "triton":
        return kernel("gemm")(a, b, out_dtype, transpose_b=transpose_b)
    return gemm_reference(a, b.t() if transpose_b else b, out_dtype)


def row_slice(t: NVFP4Tensor, start: int, end: int) -> NVFP4Tensor:
    """Rows [start, end) of a (1, 16)-block tensor (the global scale is sliced too when per row)."""
    if t.block != (1, 16):
        raise ValueError(f"row_slice needs (1, 16) blocks, got {t.block}")
    gs = t.global_scale[start:end] if t.per_row else t.global_scale
    am = t.amax if t.amax is None or not t.per_row else t.amax[start:end]
    return NVFP4Tensor(t.data[start:end], t.scale[start:end], gs, (end - start, t.shape[1]), t.block, amax=am)


def _split_points(tokens_per_expert, rows: int, experts: int) -> list[int]:
    counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                               else tokens_per_expert)]
    if len(counts) != experts:
        raise ValueError(f"grouped_gemm: {len(counts)} token counts for {experts} experts")
    if any(c < 0 for c in counts) or sum(counts) != rows:
        raise ValueError(f"grouped_gemm: token counts {counts} must be >= 0 and sum to the {rows} input rows")
    points = [0]
    for c in counts:
        points.append(points[-1] + c)
    return points


def grouped_gemm_reference(a: NVFP4Tensor, weights: list[NVFP4Tensor], tokens_per_expert,
                           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    points = _split_points(tokens_per_expert, a.shape[0], len(weights))
    n = weights[0].shape[0]
    out = torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.device)
    for e, w in enumerate(weights):
        if w.shape[0] != n:
            raise ValueError(f"grouped_gemm: expert {e} has {w.shape[0]} output rows, expert 0 has {n}")
        if points[e + 1] > points[e]:
            out[points[e]:points[e + 1]] = gemm_reference(row_slice(a, points[e], points[e + 1]), w, out_dtype)
    return out


def grouped_gemm(a: NVFP4Tensor, weights, tokens_per_expert, *, out_dtype: torch.dtype = torch.float32,
                 backend: str = "auto", transpose_weights: bool = False) -> torch.Tensor:
    """Per-expert a_e @ w_e^T over rows of `a` grouped contiguously by expert (Megatron's permuted layout).

    weights: a list of NVFP4Tensor [N, K] or an NVFP4Stack. transpose_weights: a_e @ w_e instead, with w_e^T the
    exact transpose of 16x16-block weights (the MoE dgrad; the kernels read a stack's block values in place).
    tokens_per_expert None: one member's weights, every row its group (a dense GEMM; the kernels take the row count
    as an argument, no counts tensor)."""
    if not len(weights):
        raise ValueError("grouped_gemm: no expert weights")
    if tokens_per_expert is None and len(weights) != 1:
        raise ValueError(f"grouped_gemm: tokens_per_expert None (one group of all rows) needs one member's weights, "
                         f"got {len(weights)}")
    name, _ = resolve(backend, a.data, op="gemm")
    if name == "triton":
        return kernel("grouped_gemm")(a, weights, tokens_per_expert, out_dtype, transpose_weights=transpose_weights)
    if transpose_weights:
        weights = [w.t() for w in weights]
    return grouped_gemm_reference(a, weights, [a.shape[0]] if tokens_per_expert is None else tokens_per_expert,
                                  out_dtype)
