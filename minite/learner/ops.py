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
(`sharded="out"`) sync W, dy and dy^T; row-parallel ones (`sharded="in"`) sync W, x (per row) and x^T. The
quantiser takes no amax argument, so `_quantize_scoped` appends a pad row (or a pad 16-column block for per-row
scales) whose only non-zero carries the group amax, then drops it: the pad changes no other block's scale.
Stochastic-rounding streams are indexed by element position in the *local* tensor, so backward values under TP
match the unsharded run in distribution, not bitwise; the forward matches up to fp32 summation order.

All quantisation goes through `minite.nvfp4.quantize(backend=...)` and GEMMs through `minite.nvfp4.gemm` /
`grouped_gemm`: the Triton kernels plug in behind those functions, not here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from minite.nvfp4 import NVFP4Recipe, NVFP4Tensor, OperandRecipe, apply_rht, gemm, grouped_gemm, rht_matrix

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


def _quantize_scoped(x: torch.Tensor, op: OperandRecipe, *, seed: Optional[int], backend: str,
                     amax_group=None) -> NVFP4Tensor:
    """`op.quantize(x)`, with the global-scale amax taken over `amax_group` (TP) when it has > 1 rank."""
    if _group_size(amax_group) == 1:
        return op.quantize(x, seed=seed, backend=backend)
    rows, cols = x.shape
    if op.scale_scope == "row":
        if op.rht:
            raise ValueError("per-row scales with RHT are not supported under tensor parallelism")
        g = _group_amax(x.float(), 1, amax_group)
        pad = torch.zeros(rows, 16, dtype=torch.float32, device=x.device)
        pad[:, 0] = g
        q = op.quantize(torch.cat([x.float(), pad], dim=1), seed=seed, backend=backend)
        return NVFP4Tensor(q.data[:, :cols // 2].contiguous(), q.scale[:, :cols // 16].contiguous(),
                           q.global_scale, (rows, cols), q.block)
    seen = apply_rht(x) if op.rht else x.float()
    g = _group_amax(seen, None, amax_group)
    pad = torch.zeros(op.block[0], cols, dtype=torch.float32, device=x.device)
    if op.rht:  # the pad row g * M[:, 0]: M is orthogonal, so the quantiser sees [g, 0, ..., 0] exactly
        pad[0, :16] = g * rht_matrix(x.device)[:, 0]
    else:
        pad[0, 0] = g
    padded = torch.cat([x.float(), pad], dim=0)  # fp32 holds bf16/fp16 inputs exactly
    q = op.quantize(padded, seed=seed, backend=backend)
    br = op.block[0]
    return NVFP4Tensor(q.data[:rows].contiguous(), q.scale[:rows // br].contiguous(), q.global_scale,
                       (rows, cols), q.block)


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
    y = gemm(xq, w_q, out_dtype=torch.float32, backend=backend)
    return y.to(out_dtype or x.dtype).reshape(*lead, w_q.shape[0])


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """[M, C] -> [Mp, C] with zero rows, Mp the next multiple of 16 (wgrad quantises along M)."""
    extra = (-t.shape[0]) % 16
    return torch.cat([t, t.new_zeros(extra, t.shape[1])], dim=0) if extra else t


def _wgrad(dy: torch.Tensor, x: torch.Tensor, recipe: NVFP4Recipe, seed: int, backend: str,
           dy_group=None, x_group=None) -> torch.Tensor:
    """dW [N, K] = Q(dy^T) @ Q(x^T)^T in fp32, both operands quantised along tokens (RHT per recipe)."""
    dyt = _pad_tokens(dy).t().contiguous()
    xt = _pad_tokens(x).t().contiguous()
    gq = _quantize_scoped(dyt, recipe.wgrad_gradient, seed=derive_seed(seed, _ROLES["wgrad_gradient"]),
                          backend=backend, amax_group=dy_group)
    xq = _quantize_scoped(xt, recipe.wgrad_input, seed=derive_seed(seed, _ROLES["wgrad_input"]),
                          backend=backend, amax_group=x_group)
    return gemm(gq, xq, out_dtype=torch.float32, backend=backend)


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
        if ctx.needs_input_grad[0]:
            gq = _quantize_scoped(dy2, recipe.gradient, seed=derive_seed(seed, _ROLES["gradient"]),
                                  backend=backend, amax_group=gdy)
            dx = gemm(gq, ctx.w_q.t(), out_dtype=torch.float32, backend=backend).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy2, x2, recipe, seed, backend, dy_group=gdy, x_group=gxt).to(ctx.w_dtype)
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


def nvfp4_grouped_linear_forward(x: torch.Tensor, w_q: Sequence[NVFP4Tensor], tokens_per_expert,
                                 recipe: NVFP4Recipe, *, backend: str = "auto",
                                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Forward only (no autograd): per-expert Q_act(x_e) @ w_q[e]^T; the same math as `nvfp4_grouped_linear`."""
    counts = _counts(tokens_per_expert, len(w_q), x.shape[0])
    if x.shape[0] == 0:
        return x.new_zeros(0, w_q[0].shape[0], dtype=out_dtype or x.dtype)
    xq = recipe.activation.quantize(x, backend=backend)
    return grouped_gemm(xq, list(w_q), counts, out_dtype=torch.float32, backend=backend).to(out_dtype or x.dtype)


class _NVFP4GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, recipe, seed, w_q, backend):
        if w_q is None:
            w_q = [quantize_weight(weight[e], recipe, backend=backend) for e in range(weight.shape[0])]
        y = nvfp4_grouped_linear_forward(x, w_q, counts, recipe, backend=backend)
        ctx.save_for_backward(x)
        ctx.w_q, ctx.counts, ctx.recipe, ctx.seed, ctx.backend = w_q, counts, recipe, seed, backend
        ctx.w_shape, ctx.w_dtype = weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        recipe, seed, backend, counts = ctx.recipe, ctx.seed, ctx.backend, ctx.counts
        dx = dw = None
        if ctx.needs_input_grad[0] and x.shape[0] == 0:
            dx = torch.zeros_like(x)
        elif ctx.needs_input_grad[0]:
            gq = recipe.gradient.quantize(dy.contiguous(), seed=derive_seed(seed, _ROLES["gradient"]),
                                          backend=backend)
            w_t = [w.t() for w in ctx.w_q]
            dx = grouped_gemm(gq, w_t, counts, out_dtype=torch.float32, backend=backend).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros(ctx.w_shape, dtype=torch.float32, device=x.device)
            start = 0
            for e, c in enumerate(counts):
                if c:  # an expert that saw no token has a zero gradient
                    dw[e] = _wgrad(dy[start:start + c], x[start:start + c], recipe,
                                   derive_seed(seed, 1000 + e), backend)
                start += c
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None


def nvfp4_grouped_linear(x: torch.Tensor, weight, tokens_per_expert, recipe: NVFP4Recipe, *, seed: int = 0,
                         weight_q: Optional[Sequence[NVFP4Tensor]] = None, backend: str = "auto") -> torch.Tensor:
    """Per-expert y_e = x_e @ W_e^T in NVFP4 W4A4 with autograd; rows of x [T, K] grouped by expert.

    weight: a stacked tensor [E, N, K] or a list of E tensors [N, K]. tokens_per_expert: E counts (Megatron's
    permuted layout). Activations keep per-row scales, so a token's fprop does not depend on its expert group.
    """
    if isinstance(weight, (list, tuple)):
        weight = torch.stack(list(weight))
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"nvfp4_grouped_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "match (expects x [T, K] and weight [E, N, K])")
    counts = _counts(tokens_per_expert, weight.shape[0], x.shape[0])
    return _NVFP4GroupedLinear.apply(x, weight, counts, recipe, int(seed), weight_q, backend)
