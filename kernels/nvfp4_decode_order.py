"""Packed NVFP4 codes rewritten in the decode order (minite.nvfp4.grouped.decode_order) in one launch.

The decode order (docs/nvfp4.md; `DECODE_BLOCK`, `WORD_MAG_BIT`, `WORD_SIGN_BIT` in minite.nvfp4.grouped) is the
layout the small-M W4A4 kernel reads an expert stack's packed weights in: per 128-code block 16 int32 words, word
4t + q holding, for pair i = 2a + b, code 32q + 16a + 8b + 2t + h (h = 0, 1) with its three magnitude bits at
16h + WORD_MAG_BIT[i] and its sign at 16h + WORD_SIGN_BIT[i]. Code 2j + h is nibble h of byte j, so the word gathers
bytes j = 16q + 4i + t of its block, both nibbles of each. The torch version in minite.nvfp4.grouped takes ~25
launches per 16 MiB chunk (unpack, permute, eight shifted ORs): 60 ms of a 70 ms NVFP4 weight sync on the H200
example (2.4e9 expert codes; session 18, docs/benchmarks.md); here it is one read and one write of the bytes.
Only the layout changes (tests/kernels/test_decode_order.py: bitwise the torch version).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher

BLOCK_R = 8
BLOCK_W = 64  # output words per program row (4 blocks of 128 codes)


@triton.jit
def _decode_order_kernel(data_ptr, out_ptr, R, NB, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ww = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # word index in the row
    i = tl.arange(0, 4)  # pair
    w = ww % 16
    j = (ww // 16) * 64 + 16 * (w % 4) + (w // 4)  # byte of pair 0 in the row: 64 bytes a block, + 4 i below
    byte_off = j[:, None] + 4 * i[None, :]  # [BLOCK_W, 4]
    mask = (rows < R)[:, None, None] & ((ww * 4) < NB)[None, :, None] & (i < 4)[None, None, :]
    b = tl.load(data_ptr + rows.to(tl.int64)[:, None, None] * NB + byte_off[None, :, :], mask=mask,
                other=0).to(tl.int32)
    mag_bit = (9 - 3 * i)[None, None, :]  # WORD_MAG_BIT = (9, 6, 3, 0)
    sign_bit = tl.where(i == 0, 15, tl.where(i == 1, 12, tl.where(i == 2, 14, 13)))[None, None, :]  # WORD_SIGN_BIT
    lo = b & 15
    hi = b >> 4
    part = ((lo & 7) << mag_bit) | ((lo >> 3) << sign_bit) | ((hi & 7) << (mag_bit + 16)) | \
        ((hi >> 3) << (sign_bit + 16))
    word = tl.sum(part, axis=2)  # the four pairs' bits do not overlap: their sum is their OR
    omask = (rows < R)[:, None] & ((ww * 4) < NB)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (NB // 4) + ww[None, :], word, mask=omask)


def decode_order_triton(data: torch.Tensor) -> torch.Tensor:
    """`minite.nvfp4.grouped.decode_order(data)` in one launch: packed codes uint8 [..., C/2] (C % 128 == 0) ->
    uint8 of the same shape, the decode order's int32 words as their little-endian bytes."""
    *lead, nb = data.shape
    if data.dtype != torch.uint8 or nb % 64:
        raise ValueError(f"decode_order: packed codes uint8 [..., C/2] with C % 128 == 0 expected, got {data.dtype} "
                         f"{tuple(data.shape)}")
    ensure_interpreter_compat()
    rows = data.numel() // nb if nb else 0
    out = torch.empty(rows, nb // 4, dtype=torch.int32, device=data.device)
    if out.numel():
        launcher(_decode_order_kernel)[(cdiv(rows, BLOCK_R), cdiv(nb // 4, BLOCK_W))](
            data.contiguous(), out, rows, nb, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4)
    return out.view(torch.uint8).reshape(data.shape)
