"""NVFP4 W4A4 op functions for the learner's layers: a linear and a grouped (per-expert) linear, with autograd.

The three GEMMs of y = x W^T and how each operand is quantised (roles from `NVFP4Recipe`, shared/NOTES.md s.1):
    fprop  y  = Q_act(x) @ Q_w(W)^T            x [M, K] 1x16 blocks, one global scale per row (token);
                                                W [N, K] 16x16 blocks, one global scale
    dgrad  dx = Q_grad(dy) @ Q_w(W)            dy [M, N] along N, stochastic rounding; Q_w(W)^T is the
                                                16x16 transpose of the *same* quantised W (no requantisation)
    wgrad  dW = Q_wg(dy^T) @ Q_wx(x^T)^T       both along the token dim M (zero-padded to a multiple of 16),
                                                16-point random Hadamard transform first; dy^T stochastic
Every GEMM returns fp32 (`minite.nvfp4.gemm`: exact block products, fp32 global scales); outputs are cast to the
input's dtype, gradients to the dtype of what they are the gradient of.

Stochastic rounding seeds are *derived*, never drawn: the caller passes one integer (the layers use
hash(run seed, train step, layer index)) and each role gets `derive_seed(seed, role)`. A run is then reproducible
and a resumed run draws the same rounding as an uninterrupted one.

Tensor parallelism. A global scale is the amax over its scope; when that scope spans a TP-sharded dim, each rank
sees only a slice. `amax_group` all-reduces (MAX) the amax over the TP group so that a shard quantises to exactly
the values of the same slice of the unsharded tensor (given 16-aligned shard boundaries): column-parallel layers
(`sharded="out"`) sync W, dy and dy^T; row-parallel ones (`sharded="in"`) sync W, x (per row) and x^T. The group
amax goes to the quantiser as `quantize(..., global_amax=)`.
Stochastic-rounding streams are indexed by element position in the *local* tensor, so backward values under TP
match the unsharded run in distribution, not bitwise; the forward matches up to fp32 summation order.

MoE experts (`nvfp4_grouped_linear`): the weights are an `NVFP4Stack` (each expert its own global scale, quantised
in one launch); dgrad reuses its exact 16x16 transpose (the kernels read the forward block values transposed); wgrad pads each expert's tokens to a multiple of 16 and
quantises dy^T and x^T as column segments, one per expert (`quantize_column_segments`: per expert its own global
scale and seed, bitwise what E separate wgrads would draw), then one segmented GEMM computes all dW_e.

All quantisation goes through `minite.nvfp4` (quantize, quantize_stack, quantize_column_segments) and GEMMs through
its gemm / grouped_gemm / segmented_gemm: the Triton kernels plug in behind those functions, not here. When the
GEMMs run on the kernels, operands also carry fp16 block values (written in the quantisation pass, read by the MMA
without a nibble decode), and on a GPU the per-op NaN/Inf check (a host synchronisation each) is skipped: a
non-finite input then shows as a non-finite loss / gradient norm, which the learner reports.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from minite.nvfp4 import (NVFP4Recipe, NVFP4Stack, NVFP4Tensor, OperandRecipe, apply_rht, gemm, grouped_gemm,
                          quantize_column_segments, quantize_stack, segmented_gemm)
from minite.nvfp4.backend import resolve

_M32 = 0xFFFFFFFF
_ROLES = {"gradient": 1, "wgrad_gradient": 2, "wgrad_input": 3}


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from integers (splitmix-style mixing): reproducible, well spread, in [0, 2^32)."""
    h = 0x243F6A88
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _M32


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _group_amax(values: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    amax = values.abs().amax() if dim is None else values.abs().amax(dim=dim)
    amax = amax.float().contiguous()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _quant_flags(backend: str, t: torch.Tensor) -> dict:
    """Keyword arguments for quantising `t` here: fp16 block values when the GEMMs run on the Triton kernels (they
    read them), and the NaN/Inf check only off the GPU (on it, a host synchronisation per call)."""
    return {"values": resolve(backend, t, op="gemm")[0] == "triton", "check_finite": not t.is_cuda}


def _quantize_scoped(x: torch.Tensor, op: OperandRecipe, *, seed: Optional[int], backend: str,
                     amax_group=None) -> NVFP4Tensor:
    """`op.quantize(x)`, with the global-scale amax taken over `amax_group` (TP) when it has > 1 rank; block values
    kept when the kernels will read them; the NaN/Inf check only off the GPU (see the module docstring)."""
    amax = None
    if _group_size(amax_group) > 1:
        if op.scale_scope == "row" and op.rht:
            raise ValueError("per-row scales with RHT are not supported under tensor parallelism")
        seen = apply_rht(x) if op.rht else x
        amax = _group_amax(seen, 1 if op.scale_scope == "row" else None, amax_group)
    return op.quantize(x, seed=seed, backend=backend, global_amax=amax, **_quant_flags(backend, x))


def quantize_weight(weight: torch.Tensor, recipe: NVFP4Recipe, *, backend: str = "auto",
                    amax_group=None) -> NVFP4Tensor:
    """W [N, K] with the recipe's weight role (16x16 blocks, one global scale)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight expects a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    return _quantize_scoped(weight, recipe.weight, seed=None, backend=backend, amax_group=amax_group)


def nvfp4_linear_forward(x: torch.Tensor, w_q: NVFP4Tensor, recipe: NVFP4Recipe, *, backend: str = "auto",
                         amax_group=None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Forward only (no autograd): y = Q_act(x) @ w_q^T for x [..., K]; the same math as `nvfp4_linear`."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, w_q.shape[0], dtype=out_dtype or x.dtype)
    xq = _quantize_scoped(x2, recipe.activation, seed=None, backend=backend, amax_group=amax_group)
    y = gemm(xq, w_q, out_dtype=out_dtype or x.dtype, backend=backend)  # fp32 result rounded once
    return y.reshape(*lead, w_q.shape[0])


def _padded(rows: int) -> int:
    """rows rounded up to a multiple of 16 (wgrad quantises along the tokens in 16-blocks)."""
    return rows + (-rows) % 16


def _pad_groups(t: torch.Tensor, counts: list[int], widths: list[int]) -> torch.Tensor:
    """Rows of t grouped by expert -> each group zero-padded to its width (a multiple of 16); no host sync."""
    if list(counts) == list(widths):
        return t
    dev = t.device
    starts = torch.tensor([0] + counts[:-1], dtype=torch.long).cumsum(0)
    pstarts = torch.tensor([0] + widths[:-1], dtype=torch.long).cumsum(0)
    # small host tables go over with non_blocking=True: from pageable memory that is safe and skips a stream sync
    shift = torch.repeat_interleave((pstarts - starts).to(dev, non_blocking=True),
                                    torch.tensor(counts).to(dev, non_blocking=True), output_size=t.shape[0])
    dest = torch.arange(t.shape[0], device=dev) + shift
    return t.new_zeros(sum(widths), t.shape[1]).index_copy_(0, dest, t)


def _wgrad(dy: torch.Tensor, x: torch.Tensor, recipe: NVFP4Recipe, seed: int, backend: str,
           dy_group=None, x_group=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dW [N, K] = Q(dy^T) @ Q(x^T)^T (fp32, rounded once to out_dtype), both operands quantised along tokens (RHT
    per recipe). The transposes are strided views: the quantisers read them in place."""
    rows, padded = [dy.shape[0]], [_padded(dy.shape[0])]  # one group: all tokens
    gq = _quantize_scoped(_pad_groups(dy, rows, padded).t(), recipe.wgrad_gradient,
                          seed=derive_seed(seed, _ROLES["wgrad_gradient"]), backend=backend, amax_group=dy_group)
    xq = _quantize_scoped(_pad_groups(x, rows, padded).t(), recipe.wgrad_input,
                          seed=derive_seed(seed, _ROLES["wgrad_input"]), backend=backend, amax_group=x_group)
    return gemm(gq, xq, out_dtype=out_dtype, backend=backend)


def _groups(sharded: Optional[str], tp_group):
    """(weight, activation-in, dy, x^T) amax groups for a layer sharded along 'out' (N), 'in' (K) or not."""
    if sharded not in (None, "out", "in"):
        raise ValueError(f"sharded must be None, 'out' or 'in', got {sharded!r}")
    if sharded is None or _group_size(tp_group) == 1:
        return None, None, None, None
    if sharded == "out":
        return tp_group, None, tp_group, None
    return tp_group, tp_group, None, tp_group


class _NVFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe, seed, w_q, backend, sharded, tp_group):
        gw, gx, gdy, gxt = _groups(sharded, tp_group)
        if w_q is None:
            w_q = quantize_weight(weight, recipe, backend=backend, amax_group=gw)
        y = nvfp4_linear_forward(x, w_q, recipe, backend=backend, amax_group=gx)
        ctx.save_for_backward(x)
        ctx.w_q, ctx.recipe, ctx.seed, ctx.backend = w_q, recipe, seed, backend
        ctx.groups, ctx.w_dtype = (gdy, gxt), weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        recipe, seed, backend = ctx.recipe, ctx.seed, ctx.backend
        gdy, gxt = ctx.groups
        k, n = x.shape[-1], ctx.w_q.shape[0]
        x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
        dx = dw = None
        if x2.shape[0] == 0:  # no tokens: zero gradients (a quantiser's amax needs a non-empty tensor)
            dx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
            dw = x.new_zeros(ctx.w_q.shape, dtype=ctx.w_dtype) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None, None, None, None, None
        if ctx.needs_input_grad[0]:
            gq = _quantize_scoped(dy2, recipe.gradient, seed=derive_seed(seed, _ROLES["gradient"]),
                                  backend=backend, amax_group=gdy)
            dx = gemm(gq, ctx.w_q.t(), out_dtype=x.dtype, backend=backend).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy2, x2, recipe, seed, backend, dy_group=gdy, x_group=gxt, out_dtype=ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, recipe: NVFP4Recipe, *, seed: int = 0,
                 weight_q: Optional[NVFP4Tensor] = None, backend: str = "auto", sharded: Optional[str] = None,
                 tp_group=None) -> torch.Tensor:
    """y = x @ weight^T in NVFP4 W4A4 with autograd (module docstring); x [..., K], weight [N, K] -> [..., N].

    seed: base of the stochastic-rounding seeds of this call's backward. weight_q: a cached Q_w(weight) (it must
    be the quantisation of `weight` as it is now). sharded/tp_group: see the module docstring.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"nvfp4_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expects x [..., K] and weight [N, K])")
    return _NVFP4Linear.apply(x, weight, recipe, int(seed), weight_q, backend, sharded, tp_group)


def _counts(tokens_per_expert, experts: int, rows: int) -> list[int]:
    counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                               else tokens_per_expert)]
    if len(counts) != experts or sum(counts) != rows or min(counts, default=0) < 0:
        raise ValueError(f"tokens_per_expert {counts} must have {experts} non-negative entries "
                         f"summing to the {rows} input rows")
    return counts


def quantize_expert_weights(weight: torch.Tensor, recipe: NVFP4Recipe, *, backend: str = "auto") -> NVFP4Stack:
    """Expert weights [E, N, K] with the recipe's weight role, each expert its own tensor (16x16 blocks, one global
    scale per expert): one launch on the kernels; fp16 block values kept when the kernels read them."""
    op = recipe.weight
    if weight.dim() != 3:
        raise ValueError(f"quantize_expert_weights expects [E, N, K], got shape {tuple(weight.shape)}")
    seeds = None
    if op.rounding == "stochastic":  # as quantize(seed=None): drawn from torch's generator
        seeds = [int(torch.randint(0, 2**32, ()).item()) for _ in range(weight.shape[0])]
    return quantize_stack(weight, block=op.block, rounding=op.rounding, seeds=seeds, rht=op.rht, backend=backend,
                          **_quant_flags(backend, weight))


def _as_stack(w_q) -> NVFP4Stack:
    return w_q if isinstance(w_q, NVFP4Stack) else NVFP4Stack.from_tensors(list(w_q))


def nvfp4_grouped_linear_forward(x: torch.Tensor, w_q, tokens_per_expert, recipe: NVFP4Recipe, *,
                                 backend: str = "auto", out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Forward only (no autograd): per-expert Q_act(x_e) @ w_q[e]^T; the same math as `nvfp4_grouped_linear`.
    w_q: an NVFP4Stack (`quantize_expert_weights`) or a list of per-expert NVFP4Tensors."""
    counts = _counts(tokens_per_expert, len(w_q), x.shape[0])
    if x.shape[0] == 0:
        return x.new_zeros(0, w_q[0].shape[0], dtype=out_dtype or x.dtype)
    xq = recipe.activation.quantize(x, backend=backend, **_quant_flags(backend, x))
    return grouped_gemm(xq, w_q, counts, out_dtype=out_dtype or x.dtype, backend=backend)


def _segmentable(op: OperandRecipe) -> bool:
    return op.block == (1, 16) and op.scale_scope == "tensor"


def _grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, counts: list[int], recipe: NVFP4Recipe, seed: int,
                   backend: str, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [E, N, K]: per expert e, Q(dy_e^T) @ Q(x_e^T)^T with tokens padded to a multiple of 16 and seeds derived
    from (seed, 1000 + e): exactly E separate `_wgrad` calls (the loop below), done as column segments in a
    few launches when both wgrad roles use (1, 16) blocks with one global scale (the default recipe)."""
    experts = len(counts)
    seeds = [derive_seed(seed, 1000 + e) for e in range(experts)]
    if not (_segmentable(recipe.wgrad_gradient) and _segmentable(recipe.wgrad_input)):
        dw = torch.zeros(experts, dy.shape[1], x.shape[1], dtype=out_dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:  # an expert that saw no token has a zero gradient
                dw[e] = _wgrad(dy[start:start + c], x[start:start + c], recipe, seeds[e], backend,
                               out_dtype=out_dtype)
            start += c
        return dw
    widths = [_padded(c) for c in counts]
    segs = []
    for t, op, role in ((dy, recipe.wgrad_gradient, "wgrad_gradient"), (x, recipe.wgrad_input, "wgrad_input")):
        segs.append(quantize_column_segments(
            _pad_groups(t, counts, widths).t(), widths, rounding=op.rounding, rht=op.rht,
            seeds=[derive_seed(s, _ROLES[role]) for s in seeds], backend=backend, **_quant_flags(backend, x)))
    return segmented_gemm(segs[0], segs[1], out_dtype=out_dtype, backend=backend)


class _NVFP4GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, recipe, seed, w_q, backend):
        w_q = quantize_expert_weights(weight, recipe, backend=backend) if w_q is None else _as_stack(w_q)
        y = nvfp4_grouped_linear_forward(x, w_q, counts, recipe, backend=backend)
        ctx.save_for_backward(x)
        ctx.w_q, ctx.counts, ctx.recipe, ctx.seed, ctx.backend = w_q, counts, recipe, seed, backend
        ctx.w_shape, ctx.w_dtype = weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        recipe, seed, backend, counts = ctx.recipe, ctx.seed, ctx.backend, ctx.counts
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0] and x.shape[0] == 0:
            dx = torch.zeros_like(x)
        elif ctx.needs_input_grad[0]:
            gq = recipe.gradient.quantize(dy, seed=derive_seed(seed, _ROLES["gradient"]), backend=backend,
                                          **_quant_flags(backend, dy))
            dx = grouped_gemm(gq, ctx.w_q, counts, out_dtype=x.dtype, backend=backend, transpose_weights=True)
        if ctx.needs_input_grad[1]:
            dw = _grouped_wgrad(dy, x, counts, recipe, seed, backend, ctx.w_dtype)
        return dx, dw, None, None, None, None, None


def nvfp4_grouped_linear(x: torch.Tensor, weight, tokens_per_expert, recipe: NVFP4Recipe, *, seed: int = 0,
                         weight_q=None, backend: str = "auto") -> torch.Tensor:
    """Per-expert y_e = x_e @ W_e^T in NVFP4 W4A4 with autograd; rows of x [T, K] grouped by expert.

    weight: a stacked tensor [E, N, K] or a list of E tensors [N, K]. tokens_per_expert: E counts (Megatron's
    permuted layout). weight_q: a cached quantisation of `weight` (an NVFP4Stack from `quantize_expert_weights`, or
    a list of per-expert NVFP4Tensors). Activations keep per-row scales, so a token's fprop does not depend on its
    expert group.
    """
    if isinstance(weight, (list, tuple)):
        weight = torch.stack(list(weight))
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"nvfp4_grouped_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "match (expects x [T, K] and weight [E, N, K])")
    counts = _counts(tokens_per_expert, weight.shape[0], x.shape[0])
    return _NVFP4GroupedLinear.apply(x, weight, counts, recipe, int(seed), weight_q, backend)
