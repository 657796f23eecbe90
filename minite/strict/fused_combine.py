"""The strict MoE combine (`minite.ops.experts.combine_fixed_order`) in one Triton kernel: the same sums in the same order.

`combine_fixed_order(rows, row_token, tokens)` gives out[t] = r_1 + r_2 + ... + r_k in fp32, left to right, over
token t's k rows in ascending row order (rows are expert-major, so ascending expert), the first row taken as it is
(no 0 + r_1, which would turn -0.0 into +0.0). The torch ops do it with a stable sort of the row tokens, a gather, a
cast and k - 1 additions: ~12 launches per MoE layer of a strict decode step. Here one program per (token, block of
columns) finds its token's rows itself (the positions where row_token == t, ranked by a cumsum; all k positions in
one pass, so the k loads are in flight together) and adds them in that order in fp32: additions are IEEE, so the bits
are the torch ops' (tests/strict/test_fused_combine.py: under the
interpreter on the CPU, compiled on a GPU). Every token must have exactly k = R / T rows, as combine_fixed_order's
torch ops assume (scatter_add does not). Each program scans all R row tokens: `applies` keeps it to decode-sized
batches.

The same kernel also gives the default combine's sums (`combine_in_rows_dtype`, `minite.ops.combine_scatter_add`:
Megatron's unpermute, a scatter_add of the rows into zeros in their dtype) as torch computes them on the CPU: its
scatter_add over an expanded index accumulates in fp32 and rounds once (0 + r_1 + r_2 + ... in ascending row order,
then to the rows' dtype, any NaN as NaN; tests/strict/test_fused_combine.py compares the two). On a GPU torch's
scatter_add adds with atomics in the rows' dtype, each addition rounded, in an order the hardware picks, so one step's
default combine need not equal another's; the kernel's sums are the CPU's, in a fixed order. It routes on a GPU only
once its test has passed there ("combine_rows_dtype" in `fused.PROVEN`), and then only for calls without autograd:
the learner's default combine stays torch's, so in default mode the rollout's and the learner's combines would round
differently (once against once per addition), which the default-mode log-prob gap measures before it is switched on.
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

MAX_ROWS = 4096
"""The most rows (tokens x top-k) a call routes here: each program reads every row token (decode steps up to batch
512 at top-8; a prefill's combine stays on the torch ops)."""
BLOCK_H = 512

if triton is not None:
    @triton.jit
    def _combine_kernel(rows_ptr, token_ptr, out_ptr, R, H, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ROWS_DTYPE: tl.constexpr = False):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        r = tl.arange(0, BLOCK_R)
        mine = tl.load(token_ptr + r, mask=r < R, other=-1) == t
        rank = tl.cumsum(mine.to(tl.int32), axis=0)  # 1 at t's first row, 2 at its second, ...
        j = tl.arange(0, KP)
        sel = mine[None, :] & (rank[None, :] == j[:, None] + 1)  # [KP, BLOCK_R]: row j of t where it sits
        pos = tl.sum(tl.where(sel, r[None, :], 0), axis=1).to(tl.int64)  # t's K row positions, in ascending order
        # the K loads (fp32; bf16 by its bits: exact under the interpreter too) depend on no sum before them, so
        # they are in flight together; then the adds in order
        acc = fused._load_f32(rows_ptr, tl.sum(tl.where(j == 0, pos, 0), axis=0) * H + cols, cmask)
        if ROWS_DTYPE:  # the default combine: 0 + r_1 (-0.0 becomes +0.0)
            acc = 0.0 + acc
        for i in tl.static_range(1, K):
            acc = acc + fused._load_f32(rows_ptr, tl.sum(tl.where(j == i, pos, 0), axis=0) * H + cols, cmask)
        off = t.to(tl.int64) * H + cols
        if ROWS_DTYPE and rows_ptr.dtype.element_ty == tl.bfloat16:
            # one rounding to bf16, nearest even on the bits and stored as bits (the interpreter's cast truncates
            # and mishandles subnormals); a NaN as 0x7FC0, the CPU's
            bits = acc.to(tl.uint32, bitcast=True)
            h = tl.where(acc == acc, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, 0x7FC0).to(tl.uint16)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + off, h, mask=cmask)
        else:  # fp32, or one rounding to fp16 (nearest even in the interpreter too)
            tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def applies(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> bool:
    """Whether `combine` or `combine_in_rows_dtype` takes this call: rows [R, H] (fp32/bf16/fp16) and row_token [R]
    on one device, R = k x tokens with k >= 1, R <= MAX_ROWS. Not checked (it would read row_token on the host):
    that every token has exactly k rows, as dropless top-k routing gives (`minite.ops.route`, the dispatcher); a
    token with fewer would read row 0 in place of its missing ones, one with more would lose them."""
    r = rows.shape[0] if rows.dim() == 2 else -1
    return (rows.dim() == 2 and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and row_token.shape == (r,) and row_token.device == rows.device and tokens > 0
            and 0 < r <= MAX_ROWS and r % tokens == 0)


def combine(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> torch.Tensor:
    """combine_fixed_order's bits (module docstring): fp32 [tokens, H]."""
    return _launch(rows, row_token, tokens, False)


def combine_in_rows_dtype(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> torch.Tensor:
    """The default combine's bits as torch's CPU scatter_add computes them (fp32 sums, one rounding; module
    docstring): [tokens, H] in the rows' dtype."""
    return _launch(rows, row_token, tokens, True)


def _launch(rows: torch.Tensor, row_token: torch.Tensor, tokens: int, rows_dtype: bool) -> torch.Tensor:
    """fp32 sums (the strict combine) or, rows_dtype, the sums from 0 rounded once to the rows' dtype (the
    default)."""
    if not fused.available(rows) or not applies(rows, row_token, tokens):
        what = "fused default combine" if rows_dtype else "strict fused combine"
        raise ValueError(f"{what} needs rows [R, H] and row_token [R] on a CUDA device (or TRITON_INTERPRET=1), R a "
                         f"multiple of the tokens and <= {MAX_ROWS}")
    ensure_interpreter_compat()
    r, h = rows.shape
    out = torch.empty(tokens, h, dtype=rows.dtype if rows_dtype else torch.float32, device=rows.device)
    k = r // tokens
    launcher(_combine_kernel)[(tokens, cdiv(h, BLOCK_H))](
        rows.contiguous(), row_token.contiguous(), out, r, h, K=k, KP=max(2, next_power_of_2(k)),
        BLOCK_R=next_power_of_2(r), BLOCK_H=BLOCK_H, ROWS_DTYPE=rows_dtype, num_warps=4, enable_fp_fusion=False)
    return out
