"""The MoE dispatch's rows from a routing map in one launch (megatron_patches.moe_dispatch, forward only).

For a routing map [T, E] (bool, each token's top-k experts) and router probs [T, E], Megatron's permute orders the
(token, expert) pairs expert-major, ascending token inside an expert. Row r of that order holds token row_token[r]
and prob permuted_probs[r]; tokens_per_expert[e] counts expert e's rows. `LocalTokenDispatcher` computes them with
torch ops (a transpose copy, a cumsum, a scatter, a remainder, a column sum, an index_select: ~14 launches per MoE
layer, ~36 us of a batch-64 decode step's layer on the H200); here one program does it:

    pass 1   counts[e] = sum over tokens of map[t, e]; offset[e] = counts of the experts before e
    pass 2   token blocks in order: dest[t, e] = offset[e] + (rows of e in earlier blocks) + (rows of e above t
             in this block, an exclusive cumsum down the block); row_token[dest] = t, permuted_probs[dest] = probs[t, e]

Every output is an integer or a copied value: the same tensors as the torch ops, whatever the block size (tests
compare them on the CPU under the interpreter and on the GPU). Rows at or past R = T * k (a map row with more than
k entries, which Megatron's dropless dispatcher does not expect either) are not written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import launcher, next_power_of_2

BLOCK_T = 32
MAX_TOKENS = 4096
"""Above this the torch ops run (one program loops over the token blocks: fine for decode steps and prefills of a
rollout batch, not meant for a training sequence, whose probs need autograd anyway)."""


@triton.jit
def _moe_rows_kernel(map_ptr, probs_ptr, row_token_ptr, probs_out_ptr, counts_ptr, T, E, R,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    counts = tl.zeros([BLOCK_E], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = tl.load(map_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=(t < T)[:, None] & emask[None, :],
                    other=0).to(tl.int32)
        counts += tl.sum(m, axis=0)
    tl.store(counts_ptr + e, counts.to(tl.int64), mask=emask)
    running = tl.cumsum(counts, axis=0) - counts  # rows of the experts before e, then of e's earlier blocks
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = (t < T)[:, None] & emask[None, :]
        off = t[:, None].to(tl.int64) * E + e[None, :]
        m = tl.load(map_ptr + off, mask=tmask, other=0).to(tl.int32)
        dest = running[None, :] + tl.cumsum(m, axis=0) - m
        keep = (m != 0) & (dest < R)
        tl.store(row_token_ptr + dest, (t[:, None] + 0 * e[None, :]).to(tl.int64), mask=keep)
        tl.store(probs_out_ptr + dest, tl.load(probs_ptr + off, mask=tmask & (m != 0)), mask=keep)
        running += tl.sum(m, axis=0)


def applies(routing_map: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether `moe_rows` takes these: a contiguous [T, E] bool map and probs of its shape, T <= MAX_TOKENS."""
    return (routing_map.dim() == 2 and routing_map.dtype == torch.bool and probs.shape == routing_map.shape
            and routing_map.is_contiguous() and probs.is_contiguous() and probs.device == routing_map.device
            and 0 < routing_map.shape[0] <= MAX_TOKENS)


def moe_rows(routing_map: torch.Tensor, probs: torch.Tensor, rows: int):
    """(row_token [rows] int64, permuted_probs [rows] in probs' dtype, tokens_per_expert [E] int64) of the module
    docstring; rows = T * top-k."""
    ensure_interpreter_compat()
    tokens, experts = routing_map.shape
    dev = routing_map.device
    row_token = torch.empty(rows, dtype=torch.int64, device=dev)
    permuted = torch.empty(rows, dtype=probs.dtype, device=dev)
    counts = torch.empty(experts, dtype=torch.int64, device=dev)
    launcher(_moe_rows_kernel)[(1,)](routing_map.view(torch.uint8), probs, row_token, permuted, counts, tokens,
                                     experts, rows, BLOCK_T=BLOCK_T, BLOCK_E=next_power_of_2(experts), num_warps=4)
    return row_token, permuted, counts
