"""Strict mode: switch a built Megatron-Core Qwen3-MoE model so that every forward op is batch invariant.

`apply_strict(model)` is called by `build_model(cfg)` when cfg.alignment.strict is set, so the learner and every
embedded rollout engine built from the same config run the same strict ops (the learner's one full-sequence forward
and the engine's prefill + KV-cache decode then give the same log-probs, bit for bit). What each op becomes:

| op (module)                              | strict version                                                        |
|------------------------------------------|-----------------------------------------------------------------------|
| embeddings                               | unchanged: a row lookup is exact                                      |
| RMSNorm (input, pre-MLP, q/k-norm, final)| strict_ops.rms_norm (tree sum over hidden, IEEE sqrt and division)    |
| BF16 linears (QKV, O-proj, lm_head, ...) | strict_ops.linear (fp32 products, tree over K) via `_forward_impl`    |
| NVFP4 linears and experts                | unchanged: the reference GEMM sums exact products in fp64 (exact, so  |
|                                          | order-free, below); Triton kernels reduce K in a fixed order; per-row |
|                                          | activation scales make quantisation row-local                         |
| RoPE                                     | strict_ops.sincos, then the same elementwise rotation                 |
| core attention (DotProductAttention)     | strict_ops.attention (causal by absolute position, tree over keys)    |
| router: logits, softmax, top-k           | strict linear in fp32, strict softmax, stable top-k (low index wins)  |
| BF16 experts, SwiGLU                     | strict linear per expert (on a GPU without autograd all experts in    |
|                                          | one launch, the same bits); silu = x / (1 + strict exp(-x))           |
| MoE combine                              | a token's k expert outputs summed in ascending expert order, fp32     |
|                                          | (Megatron's alltoall dispatcher, or moe_dispatch.LocalTokenDispatcher)|
| log-softmax over the vocabulary          | strict_ops.log_softmax: learner (token_logprobs) and the rollout      |
|                                          | (Megatron's controller, through `controller_log_softmax`)             |

Why the NVFP4 reference GEMM needs nothing: block values are multiples of 2^-10 below 2688 in magnitude, so each
product is a multiple of 2^-20 below 2^23 with at most 12 significant bits, and any partial sum of K products is a
multiple of 2^-20 below K * 2^22.8: exactly representable in fp64 (53 bits) for K <= 1189, and in practice far
beyond (the bound needs every element at the maximum). Exact sums do not depend on order. The fp32 global scales
are then applied elementwise.

Scope: tensor parallelism must be 1 (a TP-sharded reduction would need a fixed cross-rank order). Expert
parallelism needs nothing more: the all-to-all moves whole rows and its chunk sorts are permutations, an expert's
output row depends on that row alone, and the combine runs on the token's own rank over rows that come back in
the local permutation's expert-major layout, so it sums each token's k outputs in ascending global expert order
as with EP = 1 (tests/alignment/test_strict_ep.py: gap exactly 0, equal to the EP = 1 run). Training works: the
backward is that of the same functions in ordinary torch ops (minite.strict.ops._StrictForward, which recomputes
each op's torch twin from its inputs; the BF16 experts' backward is per expert), not of the strict graphs.

Upstream patch: RoPE is a module-level function in megatron.core.transformer.attention, called with the layer's
TransformerConfig. `apply_strict` installs once (idempotent, logged) a dispatcher in its place that runs the strict
rotation for configs marked `minite_strict` and upstream's function otherwise; default models are untouched.
Checked against Megatron-Core 0.16.1.
"""
from __future__ import annotations

import contextlib
import logging
import types

import torch

from minite.ops import combine_fixed_order
from minite.strict import ops as S

from .moe_dispatch import LocalTokenDispatcher
from .nvfp4_layers import GroupedExperts, NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
from .rope import install as install_rope_dispatch

logger = logging.getLogger(__name__)


def _bf16_linear_impl(self, input, weight, bias=None, *args, **kwargs):
    """Replaces ColumnParallelLinear/RowParallelLinear._forward_impl (TP = 1: no communication to do)."""
    y = S.linear(input, weight, out_dtype=input.dtype)
    return y + bias if bias is not None else y


def _rms_norm_forward(self, x):
    return S.rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


def _attention_forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                       attention_bias=None, packed_seq_params=None):
    """DotProductAttention.forward: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np * hn] (causal)."""
    if packed_seq_params is not None or attention_bias is not None:
        raise ValueError("strict attention: packed sequences and attention bias are not supported")
    ctx = S.attention(query, key, value, float(self.softmax_scale))  # the GQA groups as they are: the fused
    # kernel reads them in place (under autograd too: ops._StrictForward), the torch ops expand them
    return ctx.reshape(ctx.shape[0], ctx.shape[1], -1).to(query.dtype)


def _router_forward(self, input, padding_mask=None):
    """TopKRouter.forward: fp32 logits, (softmax,) stable top-k, softmax over the k; returns (probs, routing_map)."""
    cfg = self.config
    logits = S.linear(input.float(), self.weight.float()).reshape(-1, cfg.num_moe_experts)
    if cfg.moe_router_pre_softmax:
        probs_k, idx = S.topk(S.softmax(logits), self.topk)
    else:
        vals, idx = S.topk(logits, self.topk)
        probs_k = S.softmax(vals)
    if cfg.moe_router_topk_scaling_factor:
        probs_k = probs_k * cfg.moe_router_topk_scaling_factor
    replay = getattr(self, "router_replay", None)  # recording (minite.alignment.routing_replay) still works
    if replay is not None and replay.router_replay_action is not None:
        if replay.router_replay_action.value != "record":
            raise ValueError("strict mode routes identically by itself: routing replay is for default mode")
        replay.record_indices(idx)
    probs = torch.zeros_like(logits).scatter(1, idx, probs_k.to(logits.dtype))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


def _combine_postprocess(self, permuted):
    """MoEAlltoAllTokenDispatcher.combine_postprocess (any EP): out[t] = sum over t's experts in ascending expert
    order, in fp32, from a gather (no scatter_add: its accumulation order is the kernel's choice)."""
    if self.shared_experts is not None:
        self.shared_experts.linear_fc2_forward(permuted)
        self.shared_experts.post_forward_comm()
    tokens = self.hidden_shape_before_permute[0]
    rows = self.reversed_local_input_permutation_mapping      # permuted row -> token; rows are expert-major
    output = combine_fixed_order(permuted, rows, tokens).to(permuted.dtype).view(self.hidden_shape)
    if self.shared_experts is not None:
        output = output + self.shared_experts.get_output()
    return output


def _check_supported(cfg) -> None:
    if cfg.tensor_model_parallel_size != 1:
        raise ValueError(f"strict mode needs tensor parallel size 1 (got tp={cfg.tensor_model_parallel_size})")
    if cfg.apply_rope_fusion or cfg.moe_router_fusion or cfg.moe_permute_fusion:
        raise ValueError("strict mode replaces fused RoPE/router/permute kernels: turn those fusions off")
    if cfg.moe_router_score_function != "softmax" or cfg.moe_router_num_groups or cfg.moe_expert_capacity_factor:
        raise ValueError("strict mode implements the softmax top-k router without groups or token dropping")
    if cfg.moe_router_load_balancing_type not in ("none", None) or cfg.moe_z_loss_coeff:
        raise ValueError("strict mode: router aux/z losses are not implemented (set them off)")


def _bind(module, name: str, fn) -> None:
    setattr(module, name, types.MethodType(fn, module))


def apply_strict(model: torch.nn.Module) -> dict:
    """Switch every op of `model` (a GPTModel, possibly wrapped) to its strict version; idempotent.

    Returns {kind: count} of the modules switched (logged). Raises ValueError for unsupported configurations.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    _check_supported(config)
    install_rope_dispatch()  # config.minite_strict routes RoPE to strict_rope (megatron_patches.rope)
    config.minite_strict = True
    counts: dict[str, int] = {}

    def mark(kind):
        counts[kind] = counts.get(kind, 0) + 1

    for module in model.modules():
        if isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)):
            mark("nvfp4_linear (unchanged)")
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = types.MethodType(_bf16_linear_impl, module)
            mark("bf16_linear")
        elif isinstance(module, torch.nn.RMSNorm):
            _bind(module, "forward", _rms_norm_forward)
            mark("rms_norm")
        elif isinstance(module, DotProductAttention):
            _bind(module, "forward", _attention_forward)
            mark("attention")
        elif isinstance(module, TopKRouter):
            _bind(module, "forward", _router_forward)
            mark("router")
        elif isinstance(module, GroupedExperts):
            module.strict = True
            mark("experts")
        dispatcher = getattr(module, "token_dispatcher", None)
        # LocalTokenDispatcher combines in fixed order by itself (config.minite_strict); Megatron's behind it is
        # switched too, should restore_upstream_dispatch put it back
        upstream = dispatcher.upstream if isinstance(dispatcher, LocalTokenDispatcher) else dispatcher
        if isinstance(upstream, MoEAlltoAllTokenDispatcher):
            _bind(upstream, "combine_postprocess", _combine_postprocess)
        if isinstance(upstream, MoEAlltoAllTokenDispatcher) or isinstance(dispatcher, LocalTokenDispatcher):
            mark("moe_combine")
    if not counts.get("rms_norm") or not counts.get("attention"):
        raise ValueError(f"apply_strict found no RMSNorm/attention modules to switch ({counts}): "
                         "not a minite Qwen3-MoE model?")
    model.minite_strict = True
    logger.info("strict mode: %s", counts)
    return counts


class _StrictFunctional:
    """torch.nn.functional, except log_softmax, which is strict_ops.log_softmax (fp32)."""

    def __init__(self, functional):
        self._functional = functional

    def __getattr__(self, name):
        return getattr(self._functional, name)

    @staticmethod
    def log_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return S.log_softmax(x, -1 if dim is None else dim)


@contextlib.contextmanager
def controller_log_softmax(strict: bool):
    """While a strict model generates (strict=True), Megatron's TextGenerationController (which calls F.log_softmax on the step's
    logits) takes the strict log-softmax, the one the strict learner uses. A no-op for other models; the module
    global is restored on exit. Checked against Megatron-Core 0.16.1 (its only F.* calls are log_softmax)."""
    if not strict:
        yield
        return
    import megatron.core.inference.text_generation_controllers.text_generation_controller as tgc

    saved = tgc.F
    tgc.F = _StrictFunctional(saved)
    try:
        yield
    finally:
        tgc.F = saved
