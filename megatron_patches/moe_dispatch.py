"""A token dispatcher for MoELayer on one rank that holds every expert (EP = 1, TP = 1), without host synchronisation.

What it replaces, and why. Megatron-Core 0.16.1's MoEAlltoAllTokenDispatcher (the one `transformer_config` picks)
costs three host synchronisations per MoE layer on a GPU even when expert parallelism is 1: the two masked_selects of
`moe_utils.permute` (tokens and probs; a data-dependent output size each) and the event wait of
`_maybe_dtoh_and_synchronize` that brings tokens_per_expert to the host (at "before_permutation_2" whenever a rank
holds more than one expert). Around them it runs host-heavy no-ops: four `_AllToAll` autograd calls (identity with one
EP rank) and `sort_chunks_by_idxs` twice per layer, a split into E chunks and a cat back in the identity order (for
128 experts, 128-way splits and cats of tokens, probs and outputs). The allgather dispatcher is no better (a
tokens_per_expert `.cpu()` and the same masked_selects).

`LocalTokenDispatcher` computes the same rows without any of that:
    rows     the (expert, token) pairs of the routing map in expert-major order, ascending token inside an expert,
             found by a cumsum over the flattened transposed map and one scatter (no nonzero); R = tokens * top-k, as
             Megatron's dropless dispatcher assumes (`num_out_tokens`): every routing map row has k entries (the
             top-k router's, the strict router's and routing replay's do; this dispatcher does not check it, as a
             check would be a host read)
    tokens_per_expert   routing_map.sum(0), left on the device: `GroupedExperts` hands it to grouped GEMMs that read
             counts on the device (torch._grouped_mm in BF16, the Triton kernels in NVFP4) and reads it on the host
             only where a GEMM loops over experts in Python (the CPU, strict BF16) or NVFP4's wgrad needs them (autograd)
    combine  Megatron's unpermute (scatter_add into zeros in the rows' dtype, index_add_ under deterministic
             algorithms; `minite.ops.combine_scatter_add`, which on a GPU without autograd, once its kernel is
             proven there, gives the CPU's sums where upstream adds with atomics); strict: `combine_fixed_order`,
             as megatron_patches.strict does for the upstream dispatcher
On a GPU without autograd on the probs (a rollout) the rows, probs and counts come from one Triton launch
(`minite.kernels.moe_rows`: the same integers and copied values as the torch ops, which take ~14 launches), then
one index_select of the hidden states. Before it, the top-k router's dense probs and map are one launch too
(`routing_in_one_launch`, installed with the dispatcher: `moe_rows.routing_dense` after upstream's top-k and
softmax over the k, where upstream fills and scatters in six launches; the same tensors), once its GPU test has
passed (`minite.strict.fused.PROVEN`: since 2026-12-06, on an H100). With "routing_topk" proven as well (the same
day, session 38), the top-k and the softmax join that launch (`moe_rows.routing_topk`: the same experts but for
ties, the probs within a tolerance of upstream's, not its bits; the learner's no-grad forward takes it too, its
training forward upstream's, so those two forwards no longer route with the same bits, as they did with
routing_dense alone). The router's linear before them is one launch too since "router_logits" is proven (2026-12-07,
on an H100; `router_gating_in_one_launch`, `moe_rows.router_logits`: the bf16 input and weight read as they are,
products exact, fp32 sums in another order than cuBLAS's fp32 GEMM after two casts; not its bits; the same split
between the learner's no-grad and training forwards).
Every tensor the experts and the combine see is the one Megatron's dispatcher gives them (same rows, same order, same
dtypes), so outputs are bitwise those of the upstream path for the same routing tensors
(tests/megatron_patches/test_moe_dispatch.py).

Scope: installed by `use_local_dispatch(model)` on MoE layers whose dispatcher is upstream's alltoall or allgather
with one EP and one expert-TP rank, no token dropping or padding, no fused permutation, no shared-expert overlap, no
latent projection and no CUDA graphs; other layers keep their dispatcher. The embedded rollout engine and the
Learner install it. Under autograd the rows are index_select's (backward: index_add, as upstream's permute) and
the combine scatter_add's (backward: gather; `minite.ops.combine_for_training`, whose gradient also carries its
amax for FC2's dgrad), so gradients are upstream's too (tests/learner). Checked against
Megatron-Core 0.16.1.
"""
from __future__ import annotations

import logging

import torch

from minite.ops import combine_fixed_order, combine_for_training, combine_scatter_add

logger = logging.getLogger(__name__)


class LocalTokenDispatcher:
    """MoELayer's dispatcher interface (six methods) for EP = 1, TP = 1; see the module docstring."""

    def __init__(self, upstream):
        self.config = upstream.config
        self.num_local_experts = upstream.num_local_experts
        self.local_expert_indices = upstream.local_expert_indices
        self.shared_experts = None
        self.cudagraph_attrs = []
        self.valid_cudagraph_attrs = None
        self.upstream = upstream  # restore_upstream_dispatch puts it back

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        tokens, experts = routing_map.shape
        rows = tokens * self.config.moe_router_topk
        if _rows_in_one_launch(routing_map, probs):
            from minite.kernels.moe_rows import moe_rows
            self.row_token, permuted_probs, self.tokens_per_expert = moe_rows(routing_map, probs, rows)
            return hidden.index_select(0, self.row_token), permuted_probs
        flat = routing_map.T.reshape(-1)                                   # [E * T], expert-major
        dest = torch.where(flat, torch.cumsum(flat, 0) - 1, rows)          # slot of each True; the rest to a spare
        pos = torch.zeros(rows + 1, dtype=torch.long, device=flat.device)
        pos.scatter_(0, dest, torch.arange(flat.numel(), device=flat.device))
        pos = pos[:rows]                                                   # = masked_select(arange, map.T)
        self.row_token = pos % tokens
        self.tokens_per_expert = routing_map.sum(dim=0).long()
        permuted_probs = probs.T.reshape(-1).index_select(0, pos)          # = probs.T.masked_select(map.T)
        return hidden.index_select(0, self.row_token), permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
        return hidden_states

    def combine_postprocess(self, rows: torch.Tensor):
        tokens = self.hidden_shape[:-1].numel()
        if getattr(self.config, "minite_strict", False):
            out = combine_fixed_order(rows, self.row_token, tokens).to(rows.dtype)
        else:  # as upstream's unpermute: index_add_ under deterministic algorithms
            combine = combine_for_training if torch.is_grad_enabled() and rows.requires_grad else combine_scatter_add
            out = combine(rows, self.row_token, tokens, deterministic=torch.are_deterministic_algorithms_enabled())
        return out.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts):
        raise ValueError("LocalTokenDispatcher does not overlap shared experts (moe_shared_expert_overlap)")


def _rows_in_one_launch(routing_map: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the dispatch's rows come from `minite.kernels.moe_rows` (module docstring): CUDA tensors, no gradient
    to record for the probs, Triton present, and a map the kernel takes."""
    if not routing_map.is_cuda or (torch.is_grad_enabled() and probs.requires_grad):
        return False
    try:
        from minite.kernels import moe_rows
    except ImportError:  # no Triton: the torch ops
        return False
    return moe_rows.applies(routing_map, probs)


def _eligible(layer) -> bool:
    from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                MoEAlltoAllTokenDispatcher)

    d, cfg = layer.token_dispatcher, layer.config
    return (isinstance(d, (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher))
            and d.ep_size == 1 and d.tp_size == 1 and not getattr(d, "drop_and_pad", False)
            and cfg.moe_expert_capacity_factor is None and not cfg.moe_router_padding_for_quantization
            and not cfg.moe_permute_fusion and not cfg.moe_shared_expert_overlap
            and not getattr(cfg, "moe_latent_size", None) and cfg.cuda_graph_impl == "none")


def routing_in_one_launch(upstream):
    """Megatron-Core 0.16.1's `topk_routing_with_score_function`, its dense outputs built in one launch where that
    applies: CUDA logits [T, E] with no gradient to record, the softmax score function after the top-k (Qwen3-MoE's
    router: top-k of the logits, then a softmax over the k in fp32, cast back to the logits' dtype, then the scaling
    factor), no expert groups, no routing replay, no TE fusion, no deterministic algorithms (upstream's index_put
    path). There the same top-k and softmax ops run, then `moe_rows.routing_dense` (the same tensors as upstream's
    fills and scatters), or, with "routing_topk" proven, `moe_rows.routing_topk` for fp32 / bf16 / fp16 logits
    (one launch from the logits; not upstream's bits: TOPK_KERNEL); everything else is upstream's call."""
    def routing(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None,
                score_function="softmax", expert_bias=None, fused=False, router_replay=None):
        if (score_function == "softmax" and not use_pre_softmax and not group_topk and router_replay is None
                and not fused and _dense_in_one_launch(logits)):
            from minite.kernels.moe_rows import routing_dense, routing_topk
            if _topk_in_one_launch(logits):
                return routing_topk(logits, topk, scaling_factor)
            scores, top_indices = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
            if scaling_factor:
                probs = probs * scaling_factor
            return routing_dense(top_indices, probs, logits.shape[1])
        return upstream(logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
                        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias,
                        fused=fused, router_replay=router_replay)
    routing.upstream = upstream
    return routing


ROUTING_KERNEL = "routing_dense"
"""The kernel's name in `minite.strict.fused.PROVEN`, where it is since its GPU test passed (2026-12-06)."""
TOPK_KERNEL = "routing_topk"
"""`moe_rows.routing_topk`'s name there (since its GPU test passed, 2026-12-06, session 38): the top-k and the
softmax in the dense outputs' launch too (not upstream's bits: the probs within tests/tolerances.py
"router_softmax_fused", the experts the same but for ties)."""


def _dense_in_one_launch(logits: torch.Tensor) -> bool:
    """Whether `routing_in_one_launch` builds the dense outputs for these logits: CUDA [T, E], no gradient to record,
    no deterministic algorithms, the kernel proven on the GPU."""
    from minite.strict import fused
    return (ROUTING_KERNEL in fused.PROVEN and logits.is_cuda and logits.dim() == 2
            and not (torch.is_grad_enabled() and logits.requires_grad)
            and not torch.are_deterministic_algorithms_enabled())


def _topk_in_one_launch(logits: torch.Tensor) -> bool:
    """Whether the top-k and the softmax join the dense outputs' launch (`moe_rows.routing_topk`): proven on the GPU,
    and logits the kernel keys exactly (fp32, bf16, fp16; fp64 takes upstream's ops)."""
    from minite.strict import fused
    return TOPK_KERNEL in fused.PROVEN and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)


def router_gating_in_one_launch(upstream):
    """Megatron-Core 0.16.1's `router_gating_linear` (inp, weight, bias, router_dtype), one launch where that applies
    (`_gating_in_one_launch`: CUDA bf16 input and weight, no bias, an fp32 router, no gradient to record, the kernel
    proven): `moe_rows.router_logits`, fp32 logits of the bf16 operands (not cuBLAS's bits: ROUTER_LOGITS_KERNEL);
    everything else is upstream's call."""
    def gating(inp, weight, bias, router_dtype):
        if _gating_in_one_launch(inp, weight, bias, router_dtype):
            from minite.kernels.moe_rows import router_logits
            return router_logits(inp, weight)
        return upstream(inp, weight, bias, router_dtype)
    gating.upstream = upstream
    return gating


ROUTER_LOGITS_KERNEL = "router_logits"
"""`moe_rows.router_logits`'s name in `minite.strict.fused` (in PROVEN since 2026-12-07): the router's fp32
logits from its bf16 input and weight in one launch, within tests/tolerances.py "router_logits_fused" of the exact
products' sum, as cuBLAS's fp32 GEMM is (not its bits), the same for a token at any batch size."""


def _gating_in_one_launch(inp: torch.Tensor, weight: torch.Tensor, bias, router_dtype) -> bool:
    """Whether `router_gating_in_one_launch` takes this call: the kernel proven, CUDA tensors, `_gating_applies`."""
    from minite.strict import fused
    return ROUTER_LOGITS_KERNEL in fused.PROVEN and inp.is_cuda and _gating_applies(inp, weight, bias, router_dtype)


def _gating_applies(inp: torch.Tensor, weight: torch.Tensor, bias, router_dtype) -> bool:
    """The call the kernel computes (on any device): bf16 input [..., K] and weight [E, K], no bias, an fp32
    router, no gradient to record."""
    return (bias is None and router_dtype == torch.float32 and inp.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and inp.shape[-1] == weight.shape[1]
            and not (torch.is_grad_enabled() and (inp.requires_grad or weight.requires_grad)))


def _install_routing_in_one_launch() -> None:
    """Route TopKRouter's calls through `routing_in_one_launch` and `router_gating_in_one_launch` (once each; Triton
    present)."""
    from megatron.core.transformer.moe import router
    try:
        import minite.kernels.moe_rows  # noqa: F401  (no Triton: upstream's ops stay)
    except ImportError:
        return
    if not hasattr(router.topk_routing_with_score_function, "upstream"):
        router.topk_routing_with_score_function = routing_in_one_launch(router.topk_routing_with_score_function)
        logger.info("MoE: the top-k router's dense probs and map in one launch on the GPU")
    if not hasattr(router.router_gating_linear, "upstream"):
        router.router_gating_linear = router_gating_in_one_launch(router.router_gating_linear)


def use_local_dispatch(model: torch.nn.Module) -> int:
    """Give every eligible MoE layer of `model` a `LocalTokenDispatcher` (idempotent); returns how many layers have
    one. Layers that are not eligible (module docstring) keep their dispatcher. The router's dense outputs take one
    launch from then on (`routing_in_one_launch`; the same tensors, for every model in the process), and so does its
    linear (`router_gating_in_one_launch`, proven since 2026-12-07)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    n = switched = 0
    for m in model.modules():
        if not isinstance(m, MoELayer):
            continue
        if isinstance(m.token_dispatcher, LocalTokenDispatcher):
            n += 1
        elif _eligible(m):
            m.token_dispatcher = LocalTokenDispatcher(m.token_dispatcher)
            n += 1
            switched += 1
    if switched:
        logger.info("MoE: %d layers dispatch locally (EP = 1: no host synchronisation)", switched)
    if n:
        _install_routing_in_one_launch()
    return n


def restore_upstream_dispatch(model: torch.nn.Module) -> int:
    """Put Megatron's dispatchers back where `use_local_dispatch` replaced them; returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    n = 0
    for m in model.modules():
        if isinstance(m, MoELayer) and isinstance(m.token_dispatcher, LocalTokenDispatcher):
            m.token_dispatcher = m.token_dispatcher.upstream
            n += 1
    return n


def detach_dispatcher_graphs(model: torch.nn.Module) -> int:
    """Detach every tensor that Megatron-Core 0.16.1's token dispatchers keep from the last forward with its autograd
    graph (the alltoall dispatcher's `probs`, the allgather one's `local_probs`: read again, for their dtype, only by
    the next forward, which replaces them); returns how many.

    Kept with its graph, the last MoE layer's `probs` holds the whole model's backward graph up to it after backward
    has run: the saved tensors are freed, but not the functions' context attributes, which in NVFP4 are every
    layer's quantised weights (6.0 GiB at four full-width Qwen3-30B-A3B layers, measured on the H200); after a failed
    step, whose backward never ran, the saved activations too. The learner detaches them after every step."""
    n = 0
    for m in model.modules():
        dispatcher = getattr(m, "token_dispatcher", None)
        if dispatcher is None:
            continue
        for name, value in list(vars(dispatcher).items()):
            if torch.is_tensor(value) and value.grad_fn is not None:
                setattr(dispatcher, name, value.detach())
                n += 1
    return n
