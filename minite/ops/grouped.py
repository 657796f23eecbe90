"""NVFP4 W4A4 grouped (per-expert) linear with autograd, for MoE experts.

The weights are an `NVFP4Stack` (each expert its own global scale, quantised in one launch); fprop quantises the
tokens with per-row scales, so a token's result does not depend on its expert group; dgrad reuses the weights' exact
16x16 transpose (the kernels read the forward block values transposed); wgrad pads each expert's tokens to a
multiple of 16 (the quantiser pads inside: no padded copy) and quantises dy^T and x^T as column segments, one per
expert (`quantize_column_segments`: per expert its own global scale and seed, bitwise what E separate wgrads would
draw), then one segmented GEMM computes all dW_e.

Gradient accumulation (`DeferredWgrads`): with several micro-batches per step, a weight whose dW goes into Megatron's
fp32 main_grad can leave its wgrad pending: the backward keeps dy^T's and x^T's segments packed, and after the last
micro-batch one launch per weight adds every micro-batch's dW in order, bitwise the per-micro-batch additions, while
reading and writing main_grad once instead of once per micro-batch (the fp32 read-modify-write of 128 experts'
gradients is most of the per-micro-batch wgrad's time on the H200; docs/benchmarks.md, issue 17). The cost: the
packed operands of the pending micro-batches stay alive until then (0.5625 B per element of dy^T and x^T).

Saved for the backward: x^T's segments, quantised in the forward and kept packed (codes and scales, 0.5625 B per
element; the kernels' block values are written from them just before the wgrad GEMM, `NVFP4Segments.with_values`),
not x (2 B per element in bf16), as Transformer Engine keeps its column-wise quantised input. Nothing of x when the
weights need no gradient: dgrad reads dy and the weights only.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from minite.nvfp4 import (NVFP4Recipe, NVFP4Segments, NVFP4Stack, grouped_gemm, quantize_count_segments,
                          quantize_stack, segmented_gemm, segmented_gemm_passes)

from minite.nvfp4.backend import has_kernel, kernel, resolve
from minite.strict import fused as strict_fused, fused_swiglu

from .common import (ROLES, FiniteFlag, derive_seed, derive_seeds, hinted_amax, host_counts, quant_flags,
                     quantiser_checks_finite, quantize_scoped)
from .experts import swiglu
from .linear import wgrad

def _counts(tokens_per_expert, experts: int, rows: int, *, keep_tensor: bool = False):
    """The counts as a checked host list. keep_tensor (the caller's grouped GEMM reads counts from a tensor, and no
    backward will need them on the host): a tensor is passed through with its length checked only (checking its
    values would be a host synchronisation on a GPU)."""
    if keep_tensor and torch.is_tensor(tokens_per_expert):
        if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != experts:
            raise ValueError(f"tokens_per_expert of shape {tuple(tokens_per_expert.shape)} must have {experts} entries")
        if not tokens_per_expert.is_cuda:  # checking host counts costs nothing
            host_counts(tokens_per_expert.tolist(), experts, rows)
        return tokens_per_expert
    return host_counts(tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else tokens_per_expert,
                       experts, rows)


def backward_needs_host_counts(x: torch.Tensor, weight: torch.Tensor, recipe: NVFP4Recipe,
                               backend: str = "auto") -> bool:
    """Whether a grouped linear on x and weight will run a backward whose wgrad reads the counts on the host: autograd
    is on, the weight requires a gradient, and the wgrad is not the kernels' segment path, which reads them on the
    device (`quantize_count_segments`; a per-expert loop or the reference reads them on the host)."""
    return (torch.is_grad_enabled() and weight.requires_grad
            and not (_segmentable(recipe) and _kernels_read_counts(x, backend)))


def _kernels_read_counts(x: torch.Tensor, backend: str) -> bool:
    """Whether the grouped GEMM on `x` runs on the Triton kernels, which take the counts as a (device) tensor."""
    return resolve(backend, x, op="gemm")[0] == "triton"


def quantize_expert_weights(weight: torch.Tensor, recipe: NVFP4Recipe, *, backend: str = "auto",
                            values: bool = True, amax: Optional[torch.Tensor] = None) -> NVFP4Stack:
    """Expert weights [E, N, K] with the recipe's weight role, each expert its own tensor (16x16 blocks, one global
    scale per expert): one launch on the kernels; fp16 block values kept when the kernels read them, unless
    values=False (`quantize_weight`): then the kernels read the packed codes, and the stack also keeps them in the
    decode order (`decode_order`, where K % 128 == 0) with the scales decoded (`decode_scales`) for the small-M GEMMs
    of a rollout. amax: each expert's max |W_e| (fp32 [E]) known already, bitwise stack_amax(weight) (the learner's
    optimizer computes it while it writes the weight: megatron_patches.weight_copy); see `quantize_stack`."""
    op = recipe.weight
    if weight.dim() != 3:
        raise ValueError(f"quantize_expert_weights expects [E, N, K], got shape {tuple(weight.shape)}")
    seeds = None
    if op.rounding == "stochastic":  # as quantize(seed=None): drawn from torch's generator
        seeds = [int(torch.randint(0, 2**32, ()).item()) for _ in range(weight.shape[0])]
    flags = quant_flags(backend, weight, values)
    st = quantize_stack(weight, block=op.block, rounding=op.rounding, seeds=seeds, rht=op.rht, backend=backend,
                        amax=amax, **flags)
    if not values and weight.shape[2] % 128 == 0 and quant_flags(backend, weight)["values"]:  # packed, on the kernels
        st.keep_decode_order()
    return st


def _as_stack(w_q) -> NVFP4Stack:
    return w_q if isinstance(w_q, NVFP4Stack) else NVFP4Stack.from_tensors(list(w_q))


def nvfp4_grouped_linear_forward(x: torch.Tensor, w_q, tokens_per_expert, recipe: NVFP4Recipe, *,
                                 backend: str = "auto", out_dtype: Optional[torch.dtype] = None,
                                 finite: Optional[FiniteFlag] = None) -> torch.Tensor:
    """Forward only (no autograd): per-expert Q_act(x_e) @ w_q[e]^T; the same math as `nvfp4_grouped_linear`.
    w_q: an NVFP4Stack (`quantize_expert_weights`) or a list of per-expert NVFP4Tensors. finite: where x is recorded
    if the quantiser does not check it, in the quantiser's own pass on the kernels (`FiniteFlag.flag_for`)."""
    counts = _counts(tokens_per_expert, len(w_q), x.shape[0], keep_tensor=_kernels_read_counts(x, backend))
    if x.shape[0] == 0:
        return x.new_zeros(0, w_q.shape[0] if isinstance(w_q, NVFP4Stack) else w_q[0].shape[0],
                           dtype=out_dtype or x.dtype)
    xq = quantize_scoped(x, recipe.activation, seed=None, backend=backend, finite=finite)
    return grouped_gemm(xq, w_q, counts, out_dtype=out_dtype or x.dtype, backend=backend)


def quantize_weight_packed(weight: torch.Tensor, recipe: NVFP4Recipe, *, backend: str = "auto") -> NVFP4Stack:
    """A dense W [N, K] as a one-member NVFP4Stack of packed codes, on the kernels also in the decode order with its
    scales decoded (K % 128 == 0; `quantize_expert_weights(values=False)`): what `nvfp4_linear_forward_packed`
    (minite.ops.linear) reads. The codes and scales are `quantize_weight`'s (the same role: 16x16 blocks, one global
    scale)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight_packed expects a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    return quantize_expert_weights(weight[None], recipe, backend=backend, values=False)


def nvfp4_swiglu_fc2_forward(h: torch.Tensor, probs: torch.Tensor, w_q, tokens_per_expert, recipe: NVFP4Recipe, *,
                             backend: str = "auto", finite: Optional[FiniteFlag] = None,
                             strict: bool = False) -> torch.Tensor:
    """Forward only (no autograd): the experts' FC2 on their SwiGLU, per-expert Q_act(swiglu(h, probs)) @ w_q[e]^T
    with `minite.ops.experts.swiglu` (h = FC1's output [R, 2F], probs [R]; strict: strict mode's silu); `finite`
    records a (the FC2 input), as the NVFP4 layers record what they quantise, where the quantiser does not check it
    itself. Bitwise `nvfp4_grouped_linear_forward(swiglu(h, probs, strict=strict), ...)`. On the kernels, for a bf16
    h and the activation recipe (1x16 blocks, per-row scales, nearest, no RHT), the SwiGLU, the quantisation and
    the record are one launch (`minite.kernels.nvfp4_swiglu.expert_swiglu_quantize_triton`; strict:
    `minite.strict.fused_swiglu`, "swiglu" in fused.PROVEN; eight launches per MoE layer of a rollout decode step
    before, more in strict mode); elsewhere those three steps run one after the other."""
    op = recipe.activation
    flag = None if finite is None else finite.tensor(h.device)
    fused = (op.block == (1, 16) and op.scale_scope == "row" and op.rounding == "nearest" and not op.rht
             and h.dim() == 2 and h.shape[0] > 0 and h.dtype == torch.bfloat16 and h.shape[1] % 32 == 0
             and has_kernel("expert_swiglu_quantize") and _kernels_read_counts(h, backend)
             and not quantiser_checks_finite(h) and (flag is None or flag.device == h.device)
             and (not strict or strict_fused.routes(h, kernel="swiglu")))
    if not fused:
        a = swiglu(h, probs, strict=strict)
        return nvfp4_grouped_linear_forward(a, w_q, tokens_per_expert, recipe, backend=backend, finite=finite)
    counts = _counts(tokens_per_expert, len(w_q), h.shape[0], keep_tensor=True)
    quantize = fused_swiglu.swiglu_quantize if strict else kernel("expert_swiglu_quantize")
    aq = quantize(h.contiguous(), probs, flag=flag, values=quant_flags(backend, h)["values"])
    return grouped_gemm(aq, w_q, counts, out_dtype=h.dtype, backend=backend)


def _segmentable(recipe: NVFP4Recipe) -> bool:
    """Whether both wgrad roles use (1, 16) blocks with one global scale (the default recipe): the wgrad quantises
    its operands as column segments then, a few launches for all experts."""
    return all(op.block == (1, 16) and op.scale_scope == "tensor"
               for op in (recipe.wgrad_gradient, recipe.wgrad_input))


def _wgrad_seeds(seed: int, experts: int) -> np.ndarray:
    return derive_seeds(seed, 1000 + np.arange(experts))  # derive_seed(seed, 1000 + e) for each expert e


def _wgrad_segments(t: torch.Tensor, counts, recipe: NVFP4Recipe, role: str, seed: int, backend: str,
                    values: bool):
    """The wgrad operand t^T of rows t [T, C] grouped by expert: one column segment per expert, its tokens
    zero-padded to a multiple of 16 by the quantiser (no padded copy); with stochastic rounding each expert's seed is
    derive_seed(derive_seed(seed, 1000 + e), ROLES[role]) (none is derived for a role that rounds to nearest, x^T by
    default). counts: host integers, or a device tensor that the kernels read where it is (no host
    synchronisation)."""
    op = getattr(recipe, role)
    seeds = derive_seeds(_wgrad_seeds(seed, len(counts)), ROLES[role]) if op.rounding == "stochastic" else None
    return quantize_count_segments(t.t(), counts, rounding=op.rounding, rht=op.rht, seeds=seeds, backend=backend,
                                   **quant_flags(backend, t, values))


def _grouped_wgrad(dy: torch.Tensor, x: Optional[torch.Tensor], counts, recipe: NVFP4Recipe, seed: int,
                   backend: str, out_dtype: torch.dtype, x_segments: Optional[NVFP4Segments] = None,
                   accumulate: Optional[torch.Tensor] = None, zeroed: bool = False) -> torch.Tensor:
    """dW [E, N, K]: per expert e, Q(dy_e^T) @ Q(x_e^T)^T with tokens padded to a multiple of 16 and seeds derived
    from (seed, 1000 + e): exactly E separate `_wgrad` calls (the loop below), done as column segments in a
    few launches when the recipe is `_segmentable`. x_segments: x^T quantised already (`_wgrad_segments`, kept
    packed since the forward), in place of x. accumulate (segment path only): an fp32 [E, N, K] gradient that
    the fp32 dW is added to in place by the GEMM (`segmented_gemm`; `zeroed`: it holds zeros), returned."""
    experts = len(counts)
    if not _segmentable(recipe):
        seeds = _wgrad_seeds(seed, experts)
        dw = torch.zeros(experts, dy.shape[1], x.shape[1], dtype=out_dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:  # an expert that saw no token has a zero gradient
                dw[e] = wgrad(dy[start:start + c], x[start:start + c], recipe, int(seeds[e]), backend,
                               out_dtype=out_dtype)
            start += c
        return dw
    values = quant_flags(backend, dy)["values"]  # whether the kernels' GEMM reads block values
    gs, xs = _wgrad_operands(dy, x, counts, recipe, seed, backend, x_segments, values)
    return segmented_gemm(gs, xs, out_dtype=out_dtype, backend=backend, accumulate=accumulate, zeroed=zeroed)


def _wgrad_operands(dy: torch.Tensor, x: Optional[torch.Tensor], counts, recipe: NVFP4Recipe, seed: int,
                    backend: str, x_segments: Optional[NVFP4Segments], values: bool):
    """The segment wgrad's operands (dy^T, x^T): x^T from x_segments when given (kept packed since the forward),
    with fp16 block values when `values` (the GEMM reads them), packed only otherwise (a deferred wgrad)."""
    gs = _wgrad_segments(dy, counts, recipe, "wgrad_gradient", seed, backend, values)
    if x_segments is None:
        return gs, _wgrad_segments(x, counts, recipe, "wgrad_input", seed, backend, values)
    return gs, x_segments.with_values(backend) if values else x_segments


MAIN_GRAD_ZEROED = "minite_main_grad_zeroed"
"""A parameter attribute that a trainer sets (`mark_main_grads_zeroed`) right after zeroing Megatron's gradient
buffers, as the Learner does at each step's start: the parameter's main_grad holds +0.0 everywhere and nothing has
been added to it since. The first wgrad this module adds into that main_grad (at once or through `DeferredWgrads`)
then writes it without reading it (`segmented_gemm(zeroed=True)`: the same bits, 4 bytes per element not read; on
the H200 learner slice's one-sequence step 4 x 604 M expert-weight elements) and clears the attribute. Within one
step all wgrads of a weight go one way, all at once or all through the step's one `DeferredWgrads` (as the Learner
does): a wgrad added at once while a marked one is pending in a sink would be overwritten by the sink's flush."""


def mark_main_grads_zeroed(params, zeroed: bool = True) -> None:
    """Set (or clear) `MAIN_GRAD_ZEROED` on every parameter of `params` that has a main_grad."""
    for p in params:
        if getattr(p, "main_grad", None) is not None:
            setattr(p, MAIN_GRAD_ZEROED, zeroed)


def _take_zeroed(weight: torch.Tensor) -> bool:
    """Whether weight's main_grad is known to hold zeros (`MAIN_GRAD_ZEROED`); it will not after the caller's add."""
    zeroed = bool(getattr(weight, MAIN_GRAD_ZEROED, False))
    if zeroed:
        setattr(weight, MAIN_GRAD_ZEROED, False)
    return zeroed


def _main_grad(weight: torch.Tensor, recipe: NVFP4Recipe) -> Optional[torch.Tensor]:
    """The fp32 gradient buffer that Megatron-Core's DDP gave `weight` (`main_grad`, with its
    `grad_added_to_main_grad` flag), when the segment wgrad can add dW into it directly, as Megatron's and Transformer
    Engine's gradient-accumulation fusion does: dW is not written in bf16 and then added (2 + 2 + 4 + 4 bytes per
    element moved) but added once in fp32 (4 + 4), and without the bf16 rounding of each micro-batch's dW."""
    main = getattr(weight, "main_grad", None)
    if (main is None or not hasattr(weight, "grad_added_to_main_grad") or not _segmentable(recipe)
            or main.dtype != torch.float32 or main.shape != weight.shape or not main.is_contiguous()):
        return None
    return main


def _gradient_amax(dy: torch.Tensor, recipe: NVFP4Recipe) -> Optional[torch.Tensor]:
    """dy's amax from the pass that wrote it (`minite.ops.common.hint_amax`: the experts' SwiGLU backward, the
    combine's backward), for the dgrad operand's tensor-scope quantisation without an amax pass of its own; None
    where the recipe's scale is per row or taken after the RHT, or no hint holds."""
    op = recipe.gradient
    return hinted_amax(dy) if op.scale_scope == "tensor" and not op.rht else None


class DeferredWgrads:
    """Pending MoE wgrads of one train step (module docstring): `add` (from a grouped linear's backward) keeps a
    micro-batch's packed dy^T and x^T segments for a weight's fp32 main_grad, and adds a weight's pending wgrads as
    soon as it holds `max_passes` of them (which bounds the memory they hold); `flush` adds all that are left, weight
    by weight, in the order they came (`segmented_gemm_passes`); `clear` forgets them unapplied (a failed step).
    Until then, main_grad lacks the pending micro-batches' dW."""

    def __init__(self, backend: str = "auto", max_passes: int = 2):
        if max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {max_passes}")
        self.backend, self.max_passes = backend, max_passes
        self._pending: dict[int, tuple[torch.Tensor, list, list, bool]] = {}  # main_grad, dy^T's, x^T's, zeroed

    def __len__(self) -> int:
        """Pending micro-batch wgrads, over all weights."""
        return sum(len(entry[1]) for entry in self._pending.values())

    def add(self, main_grad: torch.Tensor, gs: NVFP4Segments, xs: NVFP4Segments, zeroed: bool = False) -> None:
        """zeroed: main_grad holds zeros (`MAIN_GRAD_ZEROED`; only the first micro-batch of a weight can say so)."""
        entry = self._pending.setdefault(id(main_grad), (main_grad, [], [], zeroed))
        entry[1].append(gs)
        entry[2].append(xs)
        if len(entry[1]) >= self.max_passes:
            self._apply(id(main_grad))

    def flush(self) -> None:
        for key in list(self._pending):
            self._apply(key)

    def _apply(self, key: int) -> None:
        main, a, b, zeroed = self._pending.pop(key)
        segmented_gemm_passes(a, b, main, backend=self.backend, zeroed=zeroed)

    def clear(self) -> None:
        self._pending = {}


class _NVFP4GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, recipe, seed, w_q, backend, wgrad_follows, wgrad_sink, finite):
        w_q = quantize_expert_weights(weight, recipe, backend=backend) if w_q is None else _as_stack(w_q)
        y = nvfp4_grouped_linear_forward(x, w_q, counts, recipe, backend=backend, finite=finite)
        # Only the wgrad reads x. With the segment recipe it gets x^T quantised here and kept packed until the
        # backward: 0.5625 B per element instead of x's 2 (bf16), the same bits (its rounding draws nothing from
        # the backward). The learner's peak, at the end of the forward, holds every layer's. wgrad_follows: grad
        # mode was on and the weights need a gradient (inside forward grad mode is off, and a forward without
        # autograd, e.g. a rollout's, has device counts the segment tables cannot read without a synchronisation).
        # Saved through save_for_backward (the codes, scales and scales' amaxes, and device widths; host widths on
        # ctx), so that saved-tensor hooks see them as they see every other saved activation.
        ctx.x_segmented = bool(wgrad_follows and x.shape[0] and _segmentable(recipe))
        if ctx.x_segmented:
            xs = _wgrad_segments(x, counts, recipe, "wgrad_input", seed, backend, values=False)
            widths = [xs.widths] if torch.is_tensor(xs.widths) else []
            ctx.x_widths = None if widths else xs.widths
            ctx.save_for_backward(xs.data, xs.scale, xs.global_scale, xs.amax, *widths)
        else:
            ctx.save_for_backward(x if wgrad_follows else None)
        ctx.w_q, ctx.counts, ctx.recipe, ctx.seed, ctx.backend = w_q, counts, recipe, seed, backend
        ctx.weight = weight  # the parameter: its main_grad, if Megatron's DDP gave it one (`_main_grad`)
        ctx.wgrad_sink = wgrad_sink
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x = x_segments = None
        if not ctx.x_segmented:
            (x,) = ctx.saved_tensors
        else:
            data, scale, global_scale, amax, *widths = ctx.saved_tensors
            x_segments = NVFP4Segments(data, scale, global_scale, widths[0] if widths else ctx.x_widths, None, amax)
        recipe, seed, backend, counts = ctx.recipe, ctx.seed, ctx.backend, ctx.counts
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0] and ctx.x_shape[0] == 0:
            dx = dy.new_zeros(ctx.x_shape, dtype=ctx.x_dtype)
        elif ctx.needs_input_grad[0]:
            gq = recipe.gradient.quantize(dy, seed=derive_seed(seed, ROLES["gradient"]), backend=backend,
                                          global_amax=_gradient_amax(dy, recipe), **quant_flags(backend, dy))
            dx = grouped_gemm(gq, ctx.w_q, counts, out_dtype=ctx.x_dtype, backend=backend, transpose_weights=True)
            del gq  # freed before the wgrad quantises dy^T (the backward's own peak)
        if ctx.needs_input_grad[1]:
            weight, main = ctx.weight, _main_grad(ctx.weight, recipe)
            zeroed = main is not None and _take_zeroed(weight)
            if main is not None and ctx.wgrad_sink is not None:  # pending: the sink adds it to main_grad later
                ctx.wgrad_sink.add(main, *_wgrad_operands(dy, x, counts, recipe, seed, backend, x_segments, False),
                                   zeroed=zeroed)
            else:
                dw = _grouped_wgrad(dy, x, counts, recipe, seed, backend, ctx.w_dtype, x_segments=x_segments,
                                    accumulate=main, zeroed=zeroed)
            if main is not None:  # added to main_grad already: Megatron's convention, a placeholder its DDP hook skips
                weight.grad_added_to_main_grad = True
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                dw = make(weight.shape, dtype=ctx.w_dtype, device=dy.device)
        return dx, dw, None, None, None, None, None, None, None, None


def nvfp4_grouped_linear(x: torch.Tensor, weight, tokens_per_expert, recipe: NVFP4Recipe, *, seed: int = 0,
                         weight_q=None, backend: str = "auto",
                         wgrad_sink: Optional[DeferredWgrads] = None,
                         finite: Optional[FiniteFlag] = None) -> torch.Tensor:
    """Per-expert y_e = x_e @ W_e^T in NVFP4 W4A4 with autograd; rows of x [T, K] grouped by expert.

    weight: a stacked tensor [E, N, K] or a list of E tensors [N, K]. tokens_per_expert: E counts (Megatron's
    permuted layout). weight_q: a cached quantisation of `weight` (an NVFP4Stack from `quantize_expert_weights`, or
    a list of per-expert NVFP4Tensors). Activations keep per-row scales, so a token's fprop does not depend on its
    expert group. wgrad_sink: where a weight with Megatron's fp32 main_grad leaves its wgrad pending (module
    docstring); the caller flushes it before reading main_grad. finite: a NaN/Inf flag that records x where the
    quantiser does not check it (`nvfp4_grouped_linear_forward`).
    """
    if isinstance(weight, (list, tuple)):
        weight = torch.stack(list(weight))
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"nvfp4_grouped_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "match (expects x [T, K] and weight [E, N, K])")
    counts = _counts(tokens_per_expert, weight.shape[0], x.shape[0],
                     keep_tensor=_kernels_read_counts(x, backend)
                     and not backward_needs_host_counts(x, weight, recipe, backend))
    wgrad_follows = torch.is_grad_enabled() and weight.requires_grad
    return _NVFP4GroupedLinear.apply(x, weight, counts, recipe, int(seed), weight_q, backend, wgrad_follows,
                                     wgrad_sink, finite)

