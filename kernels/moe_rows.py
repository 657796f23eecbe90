"""The MoE dispatch's rows from a routing map in one launch (megatron_patches.moe_dispatch, forward only).

For a routing map [T, E] (bool, each token's top-k experts) and router probs [T, E], Megatron's permute orders the
(token, expert) pairs expert-major, ascending token inside an expert. Row r of that order holds token row_token[r]
and prob permuted_probs[r]; tokens_per_expert[e] counts expert e's rows. `LocalTokenDispatcher` computes them with
torch ops (a transpose copy, a cumsum, a scatter, a remainder, a column sum, an index_select: ~14 launches per MoE
layer, ~36 us of a batch-64 decode step's layer on the H200); here one launch does, each program for a block of
BLOCK_T tokens:

    counts[e]   = sum over all tokens of map[t, e]            (every program reads the whole map: T <= MAX_TOKENS)
    dest[t, e]  = (rows of the experts before e) + (rows of e from tokens before the block)
                  + (rows of e above t inside the block: an exclusive cumsum down the block)
    row_token[dest] = t, permuted_probs[dest] = probs[t, e]   where map[t, e]

Every output is an integer or a copied value: the same tensors as the torch ops, whatever the block size (tests
compare them on the CPU under the interpreter and on the GPU). Megatron's dropless dispatcher expects k entries in
every map row (R = T * k rows). With fewer, the rows past the map's entries get token 0 and probs[0, 0], as the
torch ops leave them; with more, the pairs at or past R are not written (the torch ops fail there in their scatter),
and the counts still count them.

The dense routing tensors themselves (`routing_dense`): Megatron's top-k router builds its [T, E] probs and map
from the top-k indices and probs [T, k] with two zero fills, two scatters and two casts (six launches per MoE
layer); here one launch writes both, each element either a copied prob (True in the map) or zero (False);
`megatron_patches.moe_dispatch` routes the router to it ("routing_dense" in `minite.strict.fused.PROVEN`).

`routing_topk` takes one step more: from the router's logits [T, E] it also does the top-k and the softmax over the
k that precede those tensors (torch.topk and torch.softmax: two to three launches of ~12 us a layer at 64 tokens on
an H100, session 37). Per row, in fp32:

    key = the logit's bits made monotone as int32 (a total order: -0.0 below +0.0; a NaN first, as torch.topk
        ranks it; taken experts below all)
    k times: the largest key (the lowest expert of equal keys), its logit s_j; s_0 is the row's largest
    p_j = exp(s_j - s_0) / (sum over j in order 0..k-1 of exp(s_j - s_0)), cast to the logits' dtype, then times
        the scaling factor (as upstream: a product in that dtype)

The same experts as torch.topk wherever no two logits of a row tie at the k-th place (torch leaves the tie's winner
unspecified); the probs within tests/tolerances.py "router_softmax_fused" of torch's softmax (the device's exp and
another order of the k-term sum), not its bits. The learner's no-grad forward takes it too (the same wrapper), so a
rollout and that forward route alike.

`router_logits` is the router's linear before them: Megatron-Core's `router_gating_linear` with an fp32 router
(`moe_router_dtype: fp32`, Qwen3-MoE's) casts the bf16 input and weight to fp32 and multiplies them with torch.mm:
two cast launches and cuBLAS's fp32 GEMM with its split-K reduce, ~15 us of a batch-64 decode step's layer on an
H100 (session 39's profile). Here one launch reads the bf16 operands as they are:

    logits[t, e] = sum over k in BLOCK_K chunks, in order, of x[t, k] * w[e, k]     fp32 accumulation

Every product of two bf16 values is exact in fp32 (8 + 8 significant bits; short of fp32 underflow or overflow, as
in upstream's cast operands), so only the summation rounds, as in the fp32 GEMM, in another order: not cuBLAS's
bits; both within tests/tolerances.py "router_logits_fused" of the exact sum (Transformer Engine's path in upstream,
`te_general_gemm` with an fp32 output, is such a bf16 GEMM too). On a GPU the chunks are bf16 tensor-core dots with
an fp32 accumulator (the products exact, sums in the MMA's order); the CPU interpreter, whose bf16 dots are wrong,
takes fp32 dots of the values (its bf16 -> fp32 cast flushes bf16 subnormals to zero: CPU tests only). One tile
shape for every T and a fixed K order: a token's logits do not depend on the batch (tested on the GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat, interpreting
from ._launch import cdiv, launcher, next_power_of_2

BLOCK_T = 16
CHUNK_T = 64
MAX_TOKENS = 256
"""Above this (a prefill) the torch ops run: every program reads the whole map, fine for decode steps up to batch
256 (the H200, 2026-12-04: 4.1 us at 64 tokens, 9.1 us at 256; the torch ops ~30 us of kernels at 64)."""


@triton.jit
def _moe_rows_kernel(map_ptr, probs_ptr, row_token_ptr, probs_out_ptr, counts_ptr, T, E, R,
                     BLOCK_T: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    counts = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # rows of each expert from tokens before this block
    for c0 in range(0, T, CHUNK_T):
        t = c0 + tl.arange(0, CHUNK_T)
        m = tl.load(map_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=(t < T)[:, None] & emask[None, :],
                    other=0).to(tl.int32)
        counts += tl.sum(m, axis=0)
        before += tl.sum(tl.where((t < t0)[:, None], m, 0), axis=0)
    if t0 == 0:
        tl.store(counts_ptr + e, counts.to(tl.int64), mask=emask)
        total = tl.sum(counts, axis=0)
        first = tl.load(probs_ptr)
        for r0 in range(total, R, BLOCK_T * BLOCK_E):  # rows no map entry fills (fewer than k in some map row)
            r = r0 + tl.arange(0, BLOCK_T * BLOCK_E)
            tl.store(row_token_ptr + r, tl.zeros([BLOCK_T * BLOCK_E], tl.int64), mask=r < R)
            tl.store(probs_out_ptr + r, tl.zeros([BLOCK_T * BLOCK_E], tl.float32).to(first.dtype) + first,
                     mask=r < R)
    t = t0 + tl.arange(0, BLOCK_T)
    tmask = (t < T)[:, None] & emask[None, :]
    off = t[:, None].to(tl.int64) * E + e[None, :]
    m = tl.load(map_ptr + off, mask=tmask, other=0).to(tl.int32)
    dest = (tl.cumsum(counts, axis=0) - counts + before)[None, :] + tl.cumsum(m, axis=0) - m
    keep = (m != 0) & (dest < R)
    tl.store(row_token_ptr + dest, (t[:, None] + 0 * e[None, :]).to(tl.int64), mask=keep)
    tl.store(probs_out_ptr + dest, tl.load(probs_ptr + off, mask=tmask & (m != 0)), mask=keep)


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
    launcher(_moe_rows_kernel)[(cdiv(tokens, BLOCK_T),)](
        routing_map.view(torch.uint8), probs, row_token, permuted, counts, tokens, experts, rows, BLOCK_T=BLOCK_T,
        CHUNK_T=CHUNK_T, BLOCK_E=next_power_of_2(experts), num_warps=4)
    return row_token, permuted, counts


@triton.jit
def _routing_dense_kernel(top_ptr, p_ptr, probs_ptr, map_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    tmask = t < T
    prob = tl.zeros([BLOCK_T, BLOCK_E], p_ptr.dtype.element_ty)
    hit = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
    for j in tl.static_range(K):
        idx = tl.load(top_ptr + t.to(tl.int64) * K + j, mask=tmask, other=-1)
        pj = tl.load(p_ptr + t.to(tl.int64) * K + j, mask=tmask, other=0)
        eq = idx[:, None] == e[None, :]
        prob = tl.where(eq, pj[:, None], prob)
        hit = hit | eq
    off = t[:, None].to(tl.int64) * E + e[None, :]
    mask = tmask[:, None] & (e < E)[None, :]
    tl.store(probs_ptr + off, prob, mask=mask)
    tl.store(map_ptr + off, hit.to(tl.uint8), mask=mask)


def routing_dense(top_indices: torch.Tensor, probs: torch.Tensor, experts: int):
    """(routing_probs [T, E] in probs' dtype, routing_map [T, E] bool) from the top-k indices [T, k] (int64, distinct
    in a row, in [0, E)) and their probs [T, k]: zeros(T, E).scatter(1, top_indices, probs) and the map of the same
    entries, in one launch (module docstring)."""
    if top_indices.dim() != 2 or top_indices.dtype != torch.int64 or probs.shape != top_indices.shape \
            or probs.device != top_indices.device:
        raise ValueError(f"routing_dense: top_indices must be int64 [T, k] and probs [T, k] on its device, got "
                         f"{top_indices.dtype} {tuple(top_indices.shape)} and {tuple(probs.shape)} on {probs.device}")
    ensure_interpreter_compat()
    tokens, k = top_indices.shape
    dev = top_indices.device
    dense = torch.empty(tokens, experts, dtype=probs.dtype, device=dev)
    routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=dev)
    if tokens:
        launcher(_routing_dense_kernel)[(cdiv(tokens, BLOCK_T),)](
            top_indices.contiguous(), probs.contiguous(), dense, routing_map.view(torch.uint8), tokens, experts, K=k,
            BLOCK_T=BLOCK_T, BLOCK_E=next_power_of_2(experts), num_warps=4)
    return dense, routing_map


@triton.jit
def _routing_topk_kernel(x_ptr, probs_ptr, map_ptr, T, E, scale, K: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    tmask = t < T
    mask = tmask[:, None] & (e < E)[None, :]
    off = t[:, None].to(tl.int64) * E + e[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=float("-inf")).to(tl.float32)
    bits = tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))  # one positive NaN: above +inf below
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order = the floats' (-0.0 below +0.0)
    lowest = -2147483647 - 1
    key = tl.where(mask, key, lowest)  # past E: below every logit (k <= E, so never taken)
    hit = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
    ex = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    top = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(K):
        i = tl.argmax(key, 1, tie_break_left=True)
        sel = e[None, :] == i[:, None]
        s = tl.sum(tl.where(sel, x, 0.0), 1)
        if j == 0:
            top = s
        v = tl.exp(s - top)
        total = total + v
        ex = tl.where(sel, v[:, None], ex)
        hit = hit | sel
        key = tl.where(sel, lowest, key)
    p = tl.where(hit, ex / total[:, None], 0.0).to(probs_ptr.dtype.element_ty)
    if SCALE:
        p = (p.to(tl.float32) * scale).to(probs_ptr.dtype.element_ty)
    tl.store(probs_ptr + off, p, mask=mask)
    tl.store(map_ptr + off, hit.to(tl.uint8), mask=mask)


def routing_topk(logits: torch.Tensor, topk: int, scaling_factor: float | None = None):
    """(routing_probs [T, E] in the logits' dtype, routing_map [T, E] bool) of the router's logits [T, E]: the top-k,
    a softmax over the k and the dense tensors in one launch (module docstring)."""
    if logits.dim() != 2 or not 1 <= topk <= logits.shape[1] \
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"routing_topk: logits must be fp32/bf16/fp16 [T, E] with 1 <= topk <= E (fp64: upstream's "
                         f"ops), got {logits.dtype} {tuple(logits.shape)} and topk {topk}")
    ensure_interpreter_compat()
    tokens, experts = logits.shape
    dense = torch.empty(tokens, experts, dtype=logits.dtype, device=logits.device)
    routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=logits.device)
    if tokens:
        launcher(_routing_topk_kernel)[(cdiv(tokens, BLOCK_T),)](
            logits.contiguous(), dense, routing_map.view(torch.uint8), tokens, experts, float(scaling_factor or 1.0),
            K=topk, BLOCK_T=BLOCK_T, BLOCK_E=next_power_of_2(experts), SCALE=bool(scaling_factor), num_warps=4)
    return dense, routing_map


ROUTER_BLOCK_T, ROUTER_BLOCK_E, ROUTER_BLOCK_K = 16, 16, 256
"""One tile for every T (batch invariance); 16 x 16 outputs a program: 32 programs at 64 tokens and 128 experts."""


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_x, stride_w, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BF16_DOT: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask, emask = t < T, e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # fixed, sequential K order
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_x + k[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_w + k[None, :], mask=emask[:, None] & kmask[None, :],
                    other=0.0)
        if BF16_DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    out = out_ptr + t[:, None].to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=tmask[:, None] & emask[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [..., E] = x [..., K] @ weight [E, K]^T for bf16 x and weight (module docstring)."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"router_logits: bf16 x [..., K] and weight [E, K], got {x.dtype} {tuple(x.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    ensure_interpreter_compat()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    tokens, experts = x2.shape[0], w.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens:
        launcher(_router_logits_kernel)[(cdiv(tokens, ROUTER_BLOCK_T), cdiv(experts, ROUTER_BLOCK_E))](
            x2, w, out, tokens, experts, k, x2.stride(0), w.stride(0), BLOCK_T=ROUTER_BLOCK_T,
            BLOCK_E=ROUTER_BLOCK_E, BLOCK_K=ROUTER_BLOCK_K, BF16_DOT=not interpreting(), num_warps=4, num_stages=3)
    return out.view(*lead, experts)
