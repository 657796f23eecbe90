"""Strict log-softmax at one index per row in three Triton launches: `ops.log_softmax(x)[r, idx[r]]`, the same bits.

`ops.log_softmax(x)` is z - log(tree_sum(exp(z))) with z = x - max(x), per row, fp32. A sampler needs one element
of each row (the sampled token's log-prob), and over a 151,936-token vocabulary the torch ops cost ~30 launches
and ~0.23 ms per strict decode step at batch 64 on the H200 (the max, the subtraction, exp, the zero padding to
2^18 and 18 pair levels, log, the subtraction; docs/benchmarks.md): `fused.tree_sum` routes rows of at most
`fused.MAX_WIDTH` only, since a whole padded row in one program compiles for minutes. Here a row is split into
BLOCK-wide blocks:
    1. per (row, block): the block's max (NaN if the block holds one)
    2. per (row, block): m = the row's max from the blocks' maxima, the block's pair tree of exp(x - m) (`fused._exp64`,
       `fused._pair_tree`; zero past the row's end)
    3. per row: the pair tree of the block sums (zero-padded to a power of two), L = log of it (`fused._log64`), and
       (x[idx] - m) - L
Why the bits are ops': the tree of ops.tree_sum pads the row with +0.0 to a power of two and adds adjacent pairs level
by level, so its nodes at level log2(BLOCK) are exactly the blocks' own pair trees and the levels above are the pair
tree of those block sums; more +0.0 padding changes nothing because every term is exp(...) >= +0.0 or NaN (x + 0.0
== x for those). Every other step is the same IEEE operation on the same operands (fp32 subtraction, the fp64 exp
and log of `fused`, no FMA contraction), and a max is exact in any order, with one exception that torch's own
reductions share: the sign of a zero maximum depends on the order, and it shows only in the sign of a zero
log-prob (x[idx] = -0.0 at a maximum of zero when the sum is exactly 1). A NaN anywhere in a row gives NaN, as
in the torch ops (NaN max).
Tests: tests/strict/test_fused_log_softmax.py (under the interpreter on the CPU, compiled on a GPU);
`ops.token_log_softmax` routes here once "log_softmax" is in `fused.PROVEN` (its GPU test passed).
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

BLOCK = 1024
"""Columns per program (a power of two): 149 blocks of a 151,936-token row; the pair tree of 1024 compiles in
seconds (fused.MAX_WIDTH's note has the times of wider ones)."""

if triton is not None:
    @triton.jit
    def _nan_max(v, axis: tl.constexpr):
        """max over `axis`, NaN if any element is NaN (as torch's amax; Triton's max may drop NaNs)."""
        nan = tl.max((v != v).to(tl.int32), axis=axis) > 0
        return tl.where(nan, float("nan"), tl.max(tl.where(v != v, float("-inf"), v), axis=axis))

    @triton.jit(do_not_specialize=["n", "nb"])
    def _block_max_kernel(x_ptr, pm_ptr, n, nb, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        x = fused._load_f32(x_ptr, r * n + cols, cols < n)
        x = tl.where(cols < n, x, float("-inf"))
        tl.store(pm_ptr + r * nb + b, _nan_max(x, 0))

    @triton.jit
    def _row_max(pm_ptr, r, nb, NBP: tl.constexpr):
        j = tl.arange(0, NBP)
        return _nan_max(tl.load(pm_ptr + r * nb + j, mask=j < nb, other=float("-inf")), 0)

    @triton.jit(do_not_specialize=["n", "nb"])
    def _block_sum_kernel(x_ptr, pm_ptr, ps_ptr, n, nb, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                          C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr,
                          C8: tl.constexpr, C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr,
                          C12: tl.constexpr, C13: tl.constexpr, LOG2E: tl.constexpr, LN2_HI: tl.constexpr,
                          LN2_LO: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
                          NBP: tl.constexpr, SPLIT: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        m = _row_max(pm_ptr, r, nb, NBP)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        x = fused._load_f32(x_ptr, r * n + cols, cols < n)[None, :]
        e = fused._exp64((x - m).to(tl.float64), C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12,
                         C13, LOG2E, LN2_HI, LN2_LO, RNE)
        e = tl.where((cols < n)[None, :], e, 0.0)  # the +0.0 padding of ops.tree_sum
        tl.store(ps_ptr + r * nb + b + tl.arange(0, 1), fused._pair_tree(e, LEVELS, SPLIT))  # [1]

    @triton.jit(do_not_specialize=["n", "nb"])
    def _token_kernel(x_ptr, pm_ptr, ps_ptr, idx_ptr, out_ptr, n, nb, A0: tl.constexpr, A1: tl.constexpr,
                      A2: tl.constexpr, A3: tl.constexpr, A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr,
                      A7: tl.constexpr, A8: tl.constexpr, A9: tl.constexpr, A10: tl.constexpr, A11: tl.constexpr,
                      SQRT2: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, MIN_NORMAL: tl.constexpr,
                      NBP: tl.constexpr, LEVELS: tl.constexpr, SPLIT: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        m = _row_max(pm_ptr, r, nb, NBP)
        j = tl.arange(0, NBP)
        s = fused._pair_tree(tl.load(ps_ptr + r * nb + j, mask=j < nb, other=0.0)[None, :], LEVELS, SPLIT)
        lse = fused._log64(s.to(tl.float64), A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, SQRT2, LN2_HI,
                           LN2_LO, MIN_NORMAL).to(tl.float32)
        i = tl.load(idx_ptr + r + tl.arange(0, 1))
        ok = (i >= 0) & (i < n)
        x = fused._load_f32(x_ptr, r * n + tl.where(ok, i, 0), ok)
        tl.store(out_ptr + r + tl.arange(0, 1), tl.where(ok, (x - m) - lse, float("nan")))


def applies(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether `token_log_softmax` takes this call: x [R, V] fp32/bf16/fp16 (V >= 1) and int64 idx [R] on its
    device."""
    return (x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[1] > 0
            and idx.shape == (x.shape[0],) and idx.dtype == torch.int64 and idx.device == x.device)


def token_log_softmax(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """ops.log_softmax(x)[r, idx[r]] for every row r (module docstring): fp32 [R]; an idx outside [0, V) gives NaN."""
    if not fused.available(x) or not applies(x, idx):
        raise ValueError("strict fused token_log_softmax needs x [R, V] (fp32/bf16/fp16) and int64 idx [R] on a "
                         "CUDA device (or TRITON_INTERPRET=1)")
    ensure_interpreter_compat()
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    xc, nb = x.contiguous(), cdiv(n, BLOCK)
    nbp = max(2, next_power_of_2(nb))
    pm = torch.empty(rows, nb, dtype=torch.float32, device=x.device)
    ps = torch.empty_like(pm)
    split = fused.pair_split()
    launcher(_block_max_kernel)[(rows, nb)](xc, pm, n, nb, BLOCK=BLOCK, num_warps=4)
    launcher(_block_sum_kernel)[(rows, nb)](
        xc, pm, ps, n, nb, **fused.EXP_ARGS, BLOCK=BLOCK, LEVELS=BLOCK.bit_length() - 1, NBP=nbp, SPLIT=split,
        num_warps=4, enable_fp_fusion=False)
    launcher(_token_kernel)[(rows,)](
        xc, pm, ps, idx.contiguous(), out, n, nb, **fused.LOG_ARGS, NBP=nbp, LEVELS=nbp.bit_length() - 1,
        SPLIT=split, num_warps=4, enable_fp_fusion=False)
    return out
