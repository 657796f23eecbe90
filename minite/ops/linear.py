"""NVFP4 W4A4 linear with autograd: y = x W^T as three NVFP4 GEMMs (fprop, dgrad, wgrad).

The three GEMMs and how each operand is quantised (roles from `NVFP4Recipe`, docs/nvfp4.md):
    fprop  y  = Q_act(x) @ Q_w(W)^T            x [M, K] 1x16 blocks, one global scale per row (token);
                                                W [N, K] 16x16 blocks, one global scale
    dgrad  dx = Q_grad(dy) @ Q_w(W)            dy [M, N] along N, stochastic rounding; Q_w(W)^T is the
                                                16x16 transpose of the *same* quantised W (no requantisation;
                                                the kernels read its block values transposed in place)
    wgrad  dW = Q_wg(dy^T) @ Q_wx(x^T)^T       both along the token dim M (zero-padded to a multiple of 16),
                                                16-point random Hadamard transform first; dy^T stochastic
Every GEMM returns fp32 (`minite.nvfp4.gemm`: exact block products, fp32 global scales); outputs are cast to the
input's dtype, gradients to the dtype of what they are the gradient of. Seeds, TP amax groups and the kernel-path
flags: `minite.ops.common`.

Tensor parallelism: column-parallel layers (`sharded="out"`) sync the amax of W, dy and dy^T over the TP group;
row-parallel ones (`sharded="in"`) of W, x (per row) and x^T. Stochastic-rounding streams are indexed by element
position in the *local* tensor, so backward values under TP match the unsharded run in distribution, not bitwise;
the forward matches up to fp32 summation order.

All quantisation goes through `minite.nvfp4` and GEMMs through its gemm: the Triton kernels plug in behind those
functions (minite.nvfp4.backend), not here.
"""
from __future__ import annotations

from typing import Optional

import torch

from minite.nvfp4 import NVFP4Recipe, NVFP4Stack, NVFP4Tensor, gemm, grouped_gemm
from minite.nvfp4.grouped import padded

from .common import ROLES, FiniteFlag, derive_seed, group_size, pad_rows, quantize_scoped

def quantize_weight(weight: torch.Tensor, recipe: NVFP4Recipe, *, backend: str = "auto",
                    amax_group=None, values: bool = True) -> NVFP4Tensor:
    """W [N, K] with the recipe's weight role (16x16 blocks, one global scale). values=False: no fp16 block values
    even where the kernels would read them (they read the packed codes then: the same bits, a quarter of the
    bytes; the rollout engine's choice where decoding is bound by weight bytes)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight expects a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    return quantize_scoped(weight, recipe.weight, seed=None, backend=backend, amax_group=amax_group, values=values)


def nvfp4_linear_forward(x: torch.Tensor, w_q, recipe: NVFP4Recipe, *, backend: str = "auto",
                         amax_group=None, out_dtype: Optional[torch.dtype] = None,
                         finite: Optional[FiniteFlag] = None) -> torch.Tensor:
    """Forward only (no autograd): y = Q_act(x) @ w_q^T for x [..., K]; the same math as `nvfp4_linear`. w_q: an
    NVFP4Tensor, or a one-member NVFP4Stack of packed codes (`nvfp4_linear_forward_packed`). finite: where x is
    recorded if the quantiser does not check it (`quantize_scoped`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2, dtype = x.reshape(-1, k), out_dtype or x.dtype
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, w_q.shape[0], dtype=dtype)
    xq = quantize_scoped(x2, recipe.activation, seed=None, backend=backend, amax_group=amax_group, finite=finite)
    if isinstance(w_q, NVFP4Stack):  # packed, one member (nvfp4_linear_forward_packed): one group of every row
        y = grouped_gemm(xq, w_q, None, out_dtype=dtype, backend=backend)
    else:
        y = gemm(xq, w_q, out_dtype=dtype, backend=backend)  # fp32 result rounded once
    return y.reshape(*lead, w_q.shape[0])


def nvfp4_linear_forward_packed(x: torch.Tensor, w_q: NVFP4Stack, recipe: NVFP4Recipe, *, backend: str = "auto",
                                out_dtype: Optional[torch.dtype] = None,
                                finite: Optional[FiniteFlag] = None) -> torch.Tensor:
    """Forward only: y = Q_act(x) @ W^T for x [..., K] with W from `quantize_weight_packed` (minite.ops.grouped): the
    grouped GEMM with one group of all rows (the dense GEMM is that kernel with one group too), reading ~0.51 B a
    weight (codes and scales) instead of the fp16 block values' 2 B: bitwise `nvfp4_linear_forward` on the same
    weight (a rollout's decode-size GEMMs; the row count is a kernel argument, as the dense GEMM's: no counts tensor,
    no launch to fill one)."""
    if not isinstance(w_q, NVFP4Stack) or len(w_q) != 1:
        raise ValueError("nvfp4_linear_forward_packed: w_q must be a one-member NVFP4Stack (quantize_weight_packed)")
    return nvfp4_linear_forward(x, w_q, recipe, backend=backend, out_dtype=out_dtype, finite=finite)



def wgrad(dy: torch.Tensor, x: torch.Tensor, recipe: NVFP4Recipe, seed: int, backend: str,
           dy_group=None, x_group=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dW [N, K] = Q(dy^T) @ Q(x^T)^T (fp32, rounded once to out_dtype), both operands quantised along tokens (RHT
    per recipe). The transposes are strided views: the quantisers read them in place."""
    rows = padded(dy.shape[0])  # all tokens, zero-padded to a multiple of 16
    gq = quantize_scoped(pad_rows(dy, rows).t(), recipe.wgrad_gradient,
                          seed=derive_seed(seed, ROLES["wgrad_gradient"]), backend=backend, amax_group=dy_group)
    xq = quantize_scoped(pad_rows(x, rows).t(), recipe.wgrad_input,
                          seed=derive_seed(seed, ROLES["wgrad_input"]), backend=backend, amax_group=x_group)
    return gemm(gq, xq, out_dtype=out_dtype, backend=backend)


def _groups(sharded: Optional[str], tp_group):
    """(weight, activation-in, dy, x^T) amax groups for a layer sharded along 'out' (N), 'in' (K) or not."""
    if sharded not in (None, "out", "in"):
        raise ValueError(f"sharded must be None, 'out' or 'in', got {sharded!r}")
    if sharded is None or group_size(tp_group) == 1:
        return None, None, None, None
    if sharded == "out":
        return tp_group, None, tp_group, None
    return tp_group, tp_group, None, tp_group


class _NVFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe, seed, w_q, backend, sharded, tp_group, finite):
        gw, gx, gdy, gxt = _groups(sharded, tp_group)
        if w_q is None:
            w_q = quantize_weight(weight, recipe, backend=backend, amax_group=gw)
        y = nvfp4_linear_forward(x, w_q, recipe, backend=backend, amax_group=gx, finite=finite)
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
            return dx, dw, None, None, None, None, None, None, None
        if ctx.needs_input_grad[0]:
            gq = quantize_scoped(dy2, recipe.gradient, seed=derive_seed(seed, ROLES["gradient"]),
                                  backend=backend, amax_group=gdy)
            dx = gemm(gq, ctx.w_q, out_dtype=x.dtype, backend=backend, transpose_b=True).reshape(x.shape)
            del gq  # freed before the wgrad quantises dy^T and x^T (the backward's own peak)
        if ctx.needs_input_grad[1]:
            dw = wgrad(dy2, x2, recipe, seed, backend, dy_group=gdy, x_group=gxt, out_dtype=ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, recipe: NVFP4Recipe, *, seed: int = 0,
                 weight_q: Optional[NVFP4Tensor] = None, backend: str = "auto", sharded: Optional[str] = None,
                 tp_group=None, finite: Optional[FiniteFlag] = None) -> torch.Tensor:
    """y = x @ weight^T in NVFP4 W4A4 with autograd (module docstring); x [..., K], weight [N, K] -> [..., N].

    seed: base of the stochastic-rounding seeds of this call's backward. weight_q: a cached Q_w(weight) (it must
    be the quantisation of `weight` as it is now). sharded/tp_group: see the module docstring. finite: a NaN/Inf
    flag that records x where the quantiser does not check it (`minite.ops.common.quantize_scoped`).
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"nvfp4_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expects x [..., K] and weight [N, K])")
    return _NVFP4Linear.apply(x, weight, recipe, int(seed), weight_q, backend, sharded, tp_group, finite)

