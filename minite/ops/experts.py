"""The MoE expert arithmetic, written once: routing rows to experts, the SwiGLU experts, and the combine.

Every engine that computes Qwen3-MoE experts calls these functions (the learner's Megatron `GroupedExperts`, its
strict switch in `megatron_patches.strict`, and SGLang's `minite_nvfp4` MoE method in default and strict mode), so
the arithmetic that learner/rollout alignment depends on cannot drift between copies:

    rows     a token's rows grouped by expert, ascending; inside an expert, ascending token order
             (Megatron's moe_utils.permute; `route`)
    experts  h = fc1(x_e); act = silu(gate) * up * router prob, in fp32, rounded once to h's dtype; out = fc2(act)
             (`swiglu_experts`; fc1/fc2 are grouped GEMMs chosen by the caller: NVFP4, BF16, or strict BF16;
             default mode's SwiGLU, once proven on the GPU, in one Triton launch each way: `swiglu_kernels_apply`)
    combine  default: scatter_add of the rows into zeros in their dtype (Megatron's unpermute: torch sums in
             fp32 and rounds once on the CPU, adds with atomics in the rows' dtype on a GPU); strict: each token's
             k rows summed in ascending expert order in fp32 from a gather, which no kernel can reorder
             (`combine_fixed_order`)

Strict mode (`strict=True`) changes two things only: SiLU is `minite.strict.ops.silu` (x / (1 + strict exp(-x)),
fp32) instead of torch's, and the combine is the fixed-order sum. Both are explicit arguments.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from minite.nvfp4.backend import has_kernel, kernel
from minite.nvfp4.device_copy import int32_to
from minite.strict import fused, fused_combine, ops as S, triton_gemm

from .common import hint_amax, host_counts, lazy_abs_max

GroupedLinear = Callable[[torch.Tensor, int], torch.Tensor]
"""fc(a, which): the grouped GEMM of fc1 (which=0) or fc2 (which=1) over rows grouped by expert."""


def swiglu(h: torch.Tensor, probs: torch.Tensor, *, strict: bool, amax_hint: bool = False) -> torch.Tensor:
    """silu(gate) * up * prob for h = [gate | up] [R, 2F] and probs [R]: fp32 products, rounded once to h's dtype.
    Default mode on a GPU, once proven there (`swiglu_kernels_apply`): the same bits in one Triton launch, and its
    backward in one (`_SwiGLUKernels`), which with amax_hint (and "expert_swiglu_amax" proven, `fused.PROVEN`)
    also takes max |dh| on the way for h's producer (an NVFP4 FC1, whose dgrad quantises dh at tensor scope:
    `minite.ops.common.hint_amax`)."""
    if not strict and swiglu_kernels_apply(h, probs):
        return _SwiGLUKernels.apply(h, probs, amax_hint)
    gate, up = torch.chunk(h, 2, dim=-1)
    silu = S.silu(gate) if strict else F.silu(gate.float())
    return (silu * up.float() * probs.unsqueeze(-1).float()).to(h.dtype)


def swiglu_kernels_apply(h: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether default-mode `swiglu` runs on minite.kernels.expert_swiglu: a CUDA bf16 h [R, 2F] with fp32 probs [R]
    on its device, the kernels loaded, and "expert_swiglu" in `fused.PROVEN` (its GPU test, tests/kernels/
    test_expert_swiglu.py: the forward's bits torch's, the backward's dh torch's autograd's, passed on sm_90 on
    2026-12-05)."""
    return ("expert_swiglu" in fused.PROVEN and fused._gpu(h) and h.dtype == torch.bfloat16 and h.dim() == 2
            and h.shape[1] % 2 == 0 and probs.dtype == torch.float32 and probs.shape == (h.shape[0],)
            and probs.device == h.device and has_kernel("expert_swiglu"))


class _SwiGLUKernels(torch.autograd.Function):
    """`swiglu` (default mode) on the kernels: the forward keeps h and probs only (torch's ops keep four fp32 [R, F]
    tensors: 16 bytes per output element against h's 4), the backward recomputes from them; dh has torch autograd's
    operations in its order, dprobs its row sums in the kernel's order (kernels/expert_swiglu.py). Not twice
    differentiable (the eager ops are): a double backward raises."""

    @staticmethod
    def forward(ctx, h, probs, amax_hint):
        ctx.save_for_backward(h, probs)
        ctx.amax_hint = amax_hint
        return kernel("expert_swiglu")(h, probs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, da):
        h, probs = ctx.saved_tensors
        if ctx.amax_hint and "expert_swiglu_amax" in fused.PROVEN:
            dh, dprobs, amax = kernel("expert_swiglu_backward")(h, probs, da, amax=True)
            hint_amax(dh, amax)
        else:
            dh, dprobs = kernel("expert_swiglu_backward")(h, probs, da)
        return dh, (dprobs if ctx.needs_input_grad[1] else None), None


def swiglu_experts(x: torch.Tensor, probs: torch.Tensor, fc: GroupedLinear, *, strict: bool,
                   amax_hint: bool = False) -> torch.Tensor:
    """The experts on rows x [R, H] grouped by expert, with router probs [R]: fc2(swiglu(fc1(x), probs)). amax_hint:
    fc1's dgrad operand takes its amax from the SwiGLU's backward (`swiglu`; an NVFP4 fc1)."""
    return fc(swiglu(fc(x, 0), probs, strict=strict, amax_hint=amax_hint), 1)


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `grouped_linear_bf16` (not strict) computes with one torch._grouped_mm: bf16 operands on a GPU."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_linear_bf16(x: torch.Tensor, weight: torch.Tensor, counts, *, strict: bool) -> torch.Tensor:
    """Per-expert x_e @ W_e^T for weight [E, N, K] in the input dtype, experts in order.

    strict: `minite.strict.ops.linear` per expert (fixed-order sums, batch invariant); on a GPU all experts in one
    launch with the same bits (without autograd: `strict_grouped_applies`; with it: `_StrictExperts`, whose backward
    writes one dx and one dW). Otherwise, on a GPU with bf16
    operands (`grouped_mm_applies`), one torch._grouped_mm (forward and both backward GEMMs grouped; a per-expert
    Python loop's weight-gradient selects would zero-fill and add a full [E, N, K] buffer per expert); elsewhere a
    loop of matmuls (fp32 accumulation inside matmul).
    counts: a host list or a tensor; a tensor on x's device gives _grouped_mm its offsets without a host
    synchronisation (the per-expert loops read counts on the host)."""
    if not strict and grouped_mm_applies(x, weight):
        if torch.is_tensor(counts) and counts.device == x.device:
            offs = counts.cumsum(0, dtype=torch.int32)
        else:
            offs = int32_to(torch.as_tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32), x.device)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    if strict and strict_grouped_applies(x, weight, counts):
        return triton_gemm.grouped_matmul_fixed_k(x, weight, counts).to(x.dtype)
    if strict and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _StrictExperts.apply(x, weight, counts)
    if torch.is_tensor(counts):
        counts = counts.tolist()
    if strict:
        return _per_expert(x, weight, counts, _strict_mm)
    return _per_expert(x, weight, counts, lambda a, w: a @ w.t())


def strict_grouped_applies(x: torch.Tensor, weight: torch.Tensor, counts=None) -> bool:
    """Whether strict `grouped_linear_bf16` takes all experts in one launch (`triton_gemm.grouped_matmul_fixed_k`, the
    per-expert loop's bits, with the counts read on the device): CUDA bf16/fp16 operands and no gradient to record
    (the loop's `strict_ops.linear` has the backward); counts: a tensor on x's device (None: not asked)."""
    return (triton_gemm.available(x, weight[0]) and weight.dim() == 3
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (counts is None or triton_gemm.grouped_available(x, weight, counts)))


class _StrictExperts(torch.autograd.Function):
    """Strict `grouped_linear_bf16` under autograd (the strict BF16 learner). Forward: the per-expert loop of
    `minite.strict.ops.linear`, or on a GPU all experts in one launch with its bits
    (`triton_gemm.grouped_matmul_fixed_k`, as the strict rollout computes them). Backward: ops.linear's own ordinary
    matmuls per expert (fp32 products of the fp32 output gradient, rounded once to the operands' dtype), each written
    into its rows of one dx and its slice of one dW. The same values as the loop under autograd, which wrote every
    expert's dW into a zero-filled [E, N, K] buffer of its own (select's backward) and its dx into an [R, K] one, then
    summed the E buffers of each: O(E) full passes over the weight a backward (with 64 experts the strict BF16
    learner took 7.7x the default's time on an H100, 1.7x with this; docs/benchmarks.md). The sums only added zeros,
    so the values are the same up to the sign of a zero (-0.0 + 0.0 is +0.0 there), which adding into Megatron's
    main_grad makes +0.0 in both."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        counts = counts.tolist() if torch.is_tensor(counts) else counts  # the learner passes host counts
        ctx.counts = counts = host_counts(counts, weight.shape[0], x.shape[0])
        ctx.save_for_backward(x, weight)
        if triton_gemm.available(x, weight[0]):
            return triton_gemm.grouped_matmul_fixed_k(x, weight, int32_to(counts, x.device)).to(x.dtype)
        return _per_expert(x, weight, counts, _strict_mm)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        start = 0
        for e, c in enumerate(ctx.counts):
            if c:
                g = dy[start:start + c].float()
                if dx is not None:
                    dx[start:start + c] = (g @ weight[e].float()).to(x.dtype)
                if dw is not None:
                    dw[e] = (g.t() @ x[start:start + c].float()).to(weight.dtype)
            start += c
        return dx, dw, None


def _strict_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One expert's strict GEMM in the rows' dtype (`minite.strict.ops.linear`)."""
    return S.linear(a, w, out_dtype=a.dtype)


def _per_expert(x: torch.Tensor, weight: torch.Tensor, counts: list[int], mm) -> torch.Tensor:
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(mm(x[start:start + c], weight[e]))
        start += c
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, weight.shape[1])


def route(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int):
    """Rows for top-k routing [T, k]: (row_token [R], row_prob [R] fp32, counts [E] int64 on topk_ids' device),
    R = T * k, rows grouped by ascending expert and, inside an expert, by ascending token (Megatron's permute).
    No host synchronisation (a CUDA graph can capture it): the counts stay a device tensor (torch.bincount would read
    the ids' max back to size its output), which the grouped GEMMs take as is."""
    t, k = topk_ids.shape
    ids = topk_ids.long()
    flat = ids.reshape(-1)                                             # token-major
    perm = torch.sort(flat, stable=True).indices                       # expert-major, token order inside
    row_token = torch.arange(t, device=ids.device).repeat_interleave(k)[perm]
    row_prob = topk_weights.float().reshape(-1)[perm]
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    return row_token, row_prob, counts


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int, fc,
                   *, strict: bool) -> torch.Tensor:
    """Routed SwiGLU experts on x [T, H] for top-k routing [T, k]: `route`, `swiglu_experts` with
    fc(a, which, counts) as the grouped GEMMs, then the combine (default: scatter_add in x's dtype; strict: the
    fixed-order fp32 sum, rounded once to x's dtype)."""
    row_token, row_prob, counts = route(topk_ids, topk_weights, experts)
    out = swiglu_experts(x.index_select(0, row_token), row_prob, lambda a, i: fc(a, i, counts), strict=strict)
    if strict:
        return combine_fixed_order(out, row_token, x.shape[0]).to(x.dtype)
    return combine_scatter_add(out, row_token, x.shape[0])


def combine_scatter_add(rows: torch.Tensor, row_token: torch.Tensor, tokens: int, *,
                        deterministic: bool = False) -> torch.Tensor:
    """Default combine: the rows scatter_add'ed into zeros in their dtype (Megatron's unpermute; deterministic:
    index_add_, as upstream under deterministic algorithms). Otherwise on a GPU without autograd, for decode-sized
    batches, once proven there ("combine_rows_dtype" in fused.PROVEN): the CPU's bits (fp32 sums, one rounding) in
    one Triton launch, where torch's CUDA scatter_add adds with atomics in no fixed order
    (`minite.strict.fused_combine.combine_in_rows_dtype`, which needs exactly k rows per token, as `route` and the
    dispatcher make them)."""
    if (not deterministic and fused_combine.applies(rows, row_token, tokens)
            and fused.routes(rows, kernel="combine_rows_dtype")):
        return fused_combine.combine_in_rows_dtype(rows, row_token, tokens)
    return _sum_rows(rows, row_token, tokens, deterministic)


def _sum_rows(rows: torch.Tensor, row_token: torch.Tensor, tokens: int, deterministic: bool) -> torch.Tensor:
    """torch's default combine: zeros in the rows' dtype, then scatter_add_ (index_add_ when deterministic)."""
    out = torch.zeros(tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    if deterministic:
        return out.index_add_(0, row_token, rows)
    return out.scatter_add_(0, row_token.unsqueeze(1).expand(-1, rows.shape[1]), rows)


def combine_for_training(rows: torch.Tensor, row_token: torch.Tensor, tokens: int, *,
                         deterministic: bool = False) -> torch.Tensor:
    """Default combine under autograd, as Megatron's unpermute: the rows scatter_add'ed into zeros in their dtype
    (deterministic: index_add_, as upstream under deterministic algorithms); the rows' gradient is the output
    gradient's rows gathered (torch's backward of both), carrying max |d_out| as its amax hint (`hint_amax`; computed
    only if asked: FC2's dgrad quantises it at tensor scope in NVFP4; none if d_out was written since). Every row is
    a copy of a row of d_out, and the caller guarantees that every token has k >= 1 rows (`route` and the learner's
    dispatcher, which drops no token, make them so), so max |d_out| is max |rows' gradient|, read from 1/k of its
    bytes; with a dropped token it could be larger, and the dgrad's bits would change."""
    return _CombineRows.apply(rows, row_token, tokens, deterministic)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_token, tokens, deterministic):
        ctx.save_for_backward(row_token)
        return _sum_rows(rows, row_token, tokens, deterministic)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        (row_token,) = ctx.saved_tensors
        drows = d_out.index_select(0, row_token)
        return hint_amax(drows, lazy_abs_max(d_out)), None, None, None


def combine_fixed_order(rows: torch.Tensor, row_token: torch.Tensor, tokens: int) -> torch.Tensor:
    """Strict combine: out[t] = sum of t's rows in ascending expert order, in fp32 (result fp32).

    Rows are expert-major, so a stable sort by token lists each token's rows in ascending expert order; the sum is
    a left-to-right loop over the k slots from a gather (no scatter_add, whose accumulation order is the kernel's).
    Every token must have the same number k of rows (no token dropping). On a GPU without autograd, for decode-sized
    batches: the same sums in one Triton launch (`minite.strict.fused_combine`, "combine" in fused.PROVEN)."""
    k = rows.shape[0] // max(tokens, 1)
    if k * tokens != rows.shape[0]:
        raise ValueError("strict combine: every token must have the same number of experts (no token dropping)")
    if fused_combine.applies(rows, row_token, tokens) and fused.routes(rows, kernel="combine"):
        return fused_combine.combine(rows, row_token, tokens)
    order = torch.sort(row_token, stable=True).indices
    gathered = rows[order].float().reshape(tokens, k, -1)
    acc = gathered[:, 0]
    for j in range(1, k):
        acc = acc + gathered[:, j]
    return acc
