"""The strict MoE combine (`minite.ops.experts.combine_fixed_order`) in one Triton kernel: the same sums in the same order.

`combine_fixed_order(rows, row_token, tokens)` gives out[t] = r_1 + r_2 + ... + r_k in fp32, left to right, over
token t's k rows in ascending row order (rows are expert-major, so ascending expert), the first row taken as it is
(no 0 + r_1, which would turn -0.0 into +0.0). The torch ops do it with a stable sort of the row tokens, a gather, a
cast and k - 1 additions: ~12 launches per MoE layer of a strict decode step. Here one program per (token, block of
columns) finds its token's rows itself (the positions where row_token == t, ranked by a cumsum) and adds them in that
order in fp32: additions are IEEE, so the bits are the torch ops' (tests/strict/test_fused_combine.py: under the
interpreter on the CPU, compiled on a GPU). Every token must have exactly k = R / T rows,
as the torch ops assume. Each program scans all R row tokens: `applies` keeps it to decode-sized batches.
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
    def _combine_kernel(rows_ptr, token_ptr, out_ptr, R, H, K, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        r = tl.arange(0, BLOCK_R)
        mine = (tl.load(token_ptr + r, mask=r < R, other=-1) == t).to(tl.int32)
        rank = tl.cumsum(mine, axis=0)  # 1 at t's first row, 2 at its second, ...
        pos = tl.sum(tl.where((mine != 0) & (rank == 1), r, 0), axis=0).to(tl.int64)
        acc = fused._load_f32(rows_ptr, pos * H + cols, cmask)  # bf16 by its bits: exact under the interpreter too
        for j in range(2, K + 1):
            pos = tl.sum(tl.where((mine != 0) & (rank == j), r, 0), axis=0).to(tl.int64)
            acc = acc + fused._load_f32(rows_ptr, pos * H + cols, cmask)
        tl.store(out_ptr + t.to(tl.int64) * H + cols, acc, mask=cmask)


def applies(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> bool:
    """Whether `combine` takes this call: rows [R, H] (fp32/bf16/fp16) and row_token [R] on one device, R = k x
    tokens with k >= 1, R <= MAX_ROWS."""
    r = rows.shape[0] if rows.dim() == 2 else -1
    return (rows.dim() == 2 and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and row_token.shape == (r,) and row_token.device == rows.device and tokens > 0
            and 0 < r <= MAX_ROWS and r % tokens == 0)


def combine(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> torch.Tensor:
    """combine_fixed_order's bits (module docstring): fp32 [tokens, H]."""
    if not fused.available(rows) or not applies(rows, row_token, tokens):
        raise ValueError("strict fused combine needs rows [R, H] and row_token [R] on a CUDA device (or "
                         f"TRITON_INTERPRET=1), R a multiple of the tokens and <= {MAX_ROWS}")
    ensure_interpreter_compat()
    r, h = rows.shape
    out = torch.empty(tokens, h, dtype=torch.float32, device=rows.device)
    launcher(_combine_kernel)[(tokens, cdiv(h, BLOCK_H))](
        rows.contiguous(), row_token.contiguous(), out, r, h, r // tokens, BLOCK_R=next_power_of_2(r),
        BLOCK_H=BLOCK_H, num_warps=4, enable_fp_fusion=False)
    return out
