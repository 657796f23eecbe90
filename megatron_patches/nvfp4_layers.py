"""NVFP4 W4A4 Megatron-Core layers: column/row-parallel linears and grouped MoE experts (no transformer-engine).

The linears subclass Megatron's own ColumnParallelLinear / RowParallelLinear and replace only the local GEMM
(`_forward_impl`, upstream's linear_with_grad_accumulation_and_async_allreduce) with `minite.ops.nvfp4_linear`.
Everything around the GEMM stays upstream's: parameter names, shapes, init, TP attributes, the identity/all-reduce
regions (copy_to / reduce_from / gather_from_tensor_model_parallel_region), bias handling, checkpoint sharding. A BF16
model and an NVFP4 model therefore have identical state dicts, and one loads into the other.
Sequence parallelism (needed by Megatron for MoE + TP training) works as upstream: the column-parallel GEMM
all-gathers the sequence (reduce-scatter in backward) and the row-parallel output is reduce-scattered by upstream.
Without it, the dgrad all-reduce of a column-parallel layer runs in copy_to_..._region's backward. Gradient-
accumulation fusion (writing wgrad into main_grad inside the GEMM) is refused with a ValueError.

`GroupedExperts` fits MoELayer's experts interface, experts(permuted_hidden, tokens_per_expert, permuted_probs) ->
(out, None), in BF16 or NVFP4 (one class, so both models share names and layouts):
    fc1_weight [E_local, 2F, H]  rows [gate; up] (SwiGLU: silu(gate) * up), each expert's W stored [N, K]
    fc2_weight [E_local, H, F]
[N, K] per expert is the layout a grouped GEMM and NVFP4's K-blocked quantisation want (no transposes) and the one
Hugging Face uses (gate_proj/up_proj/down_proj.weight). Experts are sharded by expert parallelism only
(expert_tensor_parallel_size must be 1). The arithmetic is `minite.ops.experts` (the one expert function every engine
calls): the router probability multiplies the activation in fp32 before fc2, as Megatron's GroupedMLP does.
`strict` (a field, set by megatron_patches.strict.apply_strict) selects strict SiLU and strict BF16 GEMMs.

Stochastic-rounding seeds: every NVFP4 module gets `nvfp4_layer_id` (its order in the model, set by the builder),
and its backward seed is derive_seed(run seed, ctx.step, layer id); the learner advances ctx.step per train step.

NaN/Inf: on a GPU the quantiser does not check its input (a host synchronisation per call); every module records
its quantised inputs and weights in the context's device-side `finite` flag instead, read once per generate call. An
activation's record is taken by its quantiser on the kernels, in the same pass (`FiniteFlag.flag_for`): no launch of
its own in a decode step.

Quantised weights are cached per module, keyed by (ctx.generation, storage, version counter): a weight is quantised
once per update, not once per forward (in a 2-layer model's forward 20 of the 28 quantisations are weights).
`param.copy_` / load_state_dict bump the version counter; writes through `.data` (Megatron's optimizers) do not,
so whoever writes that way calls `ctx.weights_updated()` (the Learner does at every optimizer step, just before
it, and after every load).
During a train step the Learner frees the bf16 storage of every quantised weight (`release_quantised_weights`):
between quantising a weight and the optimizer writing its update nothing reads it but the quantiser, so it is 2 B
per parameter of dead memory at the step's memory peak; `restore_quantised_weights` gives it back before the step.
The optimizer's copy of the expert weights from their masters also computes each expert's amax, which their next
quantisation uses instead of reading the weights again (megatron_patches.weight_copy; `copied_amax`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from minite.megatron_patches.cpu import gpu_present
from minite.megatron_patches.weight_copy import copied_amax
from minite.nvfp4 import NVFP4Recipe, NVFP4Stack, NVFP4Tensor
from minite.nvfp4.backend import resolve
from minite.ops import (FiniteFlag, derive_seed, group_size, grouped_linear_bf16, nvfp4_grouped_linear, nvfp4_linear,
                        nvfp4_linear_forward_packed, nvfp4_swiglu_fc2_forward, quantiser_checks_finite,
                        quantize_expert_weights, quantize_weight, quantize_weight_packed, refill_in_place,
                        swiglu_experts)
from minite.ops.experts import grouped_mm_applies, strict_grouped_applies
from minite.ops.grouped import DeferredWgrads, backward_needs_host_counts
from minite.strict import fused as strict_fused


@dataclass
class NVFP4Context:
    """State shared by every NVFP4 module of one model (not a parameter; the learner checkpoints `step`)."""

    recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
    seed: int = 0
    """Run seed; the base of all stochastic-rounding seeds."""
    step: int = 0
    """Train-step counter, advanced by the learner so each step's rounding differs and is reproducible."""
    backend: str = "auto"
    """minite.nvfp4 backend: 'auto' (Triton on CUDA tensors), 'reference' or 'triton'."""

    generation: int = 0
    """Bumped by `weights_updated()`; part of every cached quantised weight's key."""
    finite: FiniteFlag = field(default_factory=FiniteFlag)
    """Where the quantiser does not check its input (on a GPU: `quantiser_checks_finite`), the modules record here
    whether every tensor they quantise is finite; the engine reads it once per generate (`finite.check`)."""
    weight_values: bool = True
    """Quantised expert weights keep fp16 block values for the kernels (2 B per element; the learner's large-M GEMMs)
    or only the packed codes, also in the decode order (0.56 B each; the kernels decode them: the same bits, a quarter
    of the bytes, for a rollout engine's decode steps). With this off, the dense linears whose K takes the decode
    order are packed too on a GPU's kernels (DENSE_PACKED_KERNEL, proven there). Set before the first forward (or
    call weights_updated())."""
    track_finite: bool = False
    """Record into `finite` at all: set by the reader (the embedded engine). A model nobody checks (the learner, whose
    loss and grad norm show a NaN anyway) pays no extra read of every quantised tensor."""

    def record_finite(self, t: torch.Tensor) -> None:
        """Note `t` (about to be quantised) in `finite`, if tracked and the quantiser does not check it on the spot."""
        if self.track_finite and not quantiser_checks_finite(t):
            self.finite.record(t)

    @property
    def tracked_finite(self) -> Optional[FiniteFlag]:
        """`finite` if tracked, else None: what the ops take as `finite=` to record an activation as they quantise
        it."""
        return self.finite if self.track_finite else None

    weights_released: bool = False
    """Set while the learner has released the storage of the quantised weights (`release_quantised_weights`):
    every cached quantised weight is used as it is, and a weight without one is an error (its data is gone)."""

    micro_batch: int = 0
    """Index of the micro-batch inside a train step (gradient accumulation), set by the learner; part of the seeds
    from the second micro-batch on, so that the chunks of one step draw independent rounding (the first chunk's
    seeds are those of a step without accumulation)."""

    expert_wgrad_passes: int = 2
    """With several micro-batches per train step, the learner leaves the experts' wgrads into main_grad pending
    (`wgrad_sink`) and adds up to this many micro-batches' in one launch per weight: the same bits, main_grad read
    and written once per that many micro-batches, for up to this many minus one micro-batches' packed wgrad operands
    held meanwhile. 1: each micro-batch's wgrad is added at once. On the H200's 4-layer slice (8 x 4096 tokens) 1, 2
    and 8 took 0.600, 0.591 and 0.554 s per step at a peak of 62.06, 62.52 and 65.33 GiB (BF16: 0.518 s, 62.53 GiB):
    2 keeps the NVFP4 learner within BF16's memory (docs/benchmarks.md, issue 17 in the sixteenth session)."""
    wgrad_sink: Optional[DeferredWgrads] = None
    """Where the experts' wgrads wait during such a step (minite.ops.grouped.DeferredWgrads), set and flushed by the
    learner; None: each backward adds its wgrad at once."""

    fuse_weight_amax: bool = True
    """The learner's optimizer writes the expert weights from their fp32 masters with each expert's amax computed on
    the way (megatron_patches.weight_copy, where the kernels quantise them), and their next quantisation uses it
    instead of reading the weights for it: the same bits. False: Megatron's copy and the quantiser's own amax."""

    def layer_seed(self, layer_id: int) -> int:
        if self.micro_batch:
            return derive_seed(self.seed, self.step, layer_id, self.micro_batch)
        return derive_seed(self.seed, self.step, layer_id)

    def weights_updated(self) -> None:
        """Invalidate cached quantised weights. Needed after writes that bypass the parameter's version counter
        (`param.data.copy_`, as Megatron's optimizers do); `param.copy_` and load_state_dict are seen anyway."""
        self.generation += 1


def cached_weight_q(module, weight: torch.Tensor, make, slot: str = "weight", *, record: bool = True):
    """Q(weight) from `make()`, cached on the module while (generation, storage, version) are unchanged.

    A weight is quantised once per update instead of once per forward: in a decode loop that is most of the
    quantisation work (a 2-layer model quantises 20 weights and 8 activations per forward)."""
    name = f"_nvfp4_wq_cache_{slot}"
    cache = module.__dict__.get(name)
    if module.nvfp4.weights_released:  # the storage is gone, so the key would no longer match: the weight has not
        if cache is None or cache[0][3] != tuple(weight.shape):  # changed since release_quantised_weights quantised it
            raise RuntimeError(f"{type(module).__name__}: weight {slot} was released without a quantised copy")
        return cache[1]
    key = (module.nvfp4.generation, weight.data_ptr(), weight._version, tuple(weight.shape))
    if cache is None or cache[0] != key:
        if record:  # the NaN/Inf flag (weights checked on their way in pass record=False)
            module.nvfp4.record_finite(weight)
        with torch.no_grad():
            cache = (key, make())
        module.__dict__[name] = cache
    return cache[1]


def _is_normal_init(method) -> bool:
    """Megatron's init_method_normal / scaled_init_method_normal: a partial of torch.nn.init.normal_ (which takes a
    generator); any other init method keeps the CPU path."""
    return isinstance(method, functools.partial) and method.func is torch.nn.init.normal_


def release_weight_caches(model: torch.nn.Module) -> int:
    """Drop every cached quantised weight of `model` (the next forward re-quantises); returns how many.

    The learner calls it between backward and the optimizer step: the step changes every weight, so the caches
    would be rebuilt after it anyway (same bits), and holding them through the step costs ~2.5 bytes per quantised
    parameter (packed codes, fp16 block values, scales) at the moment the optimizer's own memory peaks."""
    dropped = 0
    for m in model.modules():
        for name in [n for n in vars(m) if n.startswith("_nvfp4_wq_cache_")]:
            del m.__dict__[name]
            dropped += 1
    return dropped


def _check_linear(layer, name: str) -> None:
    if layer.gradient_accumulation_fusion:
        raise ValueError(f"{name}: gradient_accumulation_fusion is not supported by the NVFP4 linears")


DENSE_PACKED_KERNEL = "dense_packed"
"""The name in `minite.strict.fused.PROVEN` (its GPU tests passed on an H100 on 2026-12-07 at the tiles it ships with;
routed, the rollout slice's decode step took the same time, see fused.PROVEN) of a rollout engine's dense linears on
packed weights: with NVFP4Context.weight_values off (the engine's `rollout.packed_weights`) every NVFP4 dense linear
(QKV, output projection, a shared expert's) whose K takes the decode order caches its weight as packed codes, also
in the decode order, and runs the grouped kernel with one group (`minite.ops.nvfp4_linear_forward_packed`: the same
bits as on fp16 block values). A GEMM then reads ~0.51 B a weight (codes and 16x16 scales) instead of 2, and the
cache holds ~1.0 B (the codes in both orders) instead of ~2.5; a prefill's GEMMs decode nibbles too, as the experts'
do. Decode-size dense GEMMs run on few programs, where the nibble decode once cost more than the bytes saved (1-4%
slower end to end in the plain order, docs/benchmarks.md); in the decode order, at its tiles, it costs what it saves."""


def _dense_packed_applies(layer, weight: torch.Tensor) -> bool:
    """The engine's choice (weight_values off), a weight whose K takes the decode order, one TP rank (the packed form
    has no amax group)."""
    return (not layer.nvfp4.weight_values and weight.dim() == 2 and weight.shape[1] % 128 == 0
            and group_size(layer.tp_group) == 1)


def _dense_packed(layer, weight: torch.Tensor) -> bool:
    """Whether `layer` keeps its weight packed for the rollout (DENSE_PACKED_KERNEL): where it applies, on a GPU's
    kernels, once proven there."""
    return (DENSE_PACKED_KERNEL in strict_fused.PROVEN and weight.is_cuda and _dense_packed_applies(layer, weight)
            and resolve(layer.nvfp4.backend, weight, op="gemm")[0] == "triton")  # the kernels: counts on the device


def _linear_weight_q(layer, weight: torch.Tensor, record: bool = True):
    ctx = layer.nvfp4
    if _dense_packed(layer, weight):
        return cached_weight_q(layer, weight, lambda: quantize_weight_packed(weight, ctx.recipe, backend=ctx.backend),
                               record=record)
    group = layer.tp_group if group_size(layer.tp_group) > 1 else None
    return cached_weight_q(layer, weight, lambda: quantize_weight(weight, ctx.recipe, backend=ctx.backend,
                                                                   amax_group=group),  # with fp16 block values
                           record=record)


def _linear(layer, x: torch.Tensor, weight: torch.Tensor, sharded: str) -> torch.Tensor:
    ctx = layer.nvfp4
    w_q = _linear_weight_q(layer, weight)
    if isinstance(w_q, NVFP4Stack):  # packed for a rollout (_dense_packed): forward only, the same bits
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise RuntimeError(f"{type(layer).__name__}: its weight is packed for a rollout engine "
                               "(NVFP4Context.weight_values off), which has no backward: run it under torch.no_grad()")
        return nvfp4_linear_forward_packed(x, w_q, ctx.recipe, backend=ctx.backend, finite=ctx.tracked_finite)
    return nvfp4_linear(x, weight, ctx.recipe, seed=ctx.layer_seed(layer.nvfp4_layer_id), weight_q=w_q,
                        backend=ctx.backend, sharded=sharded, tp_group=layer.tp_group, finite=ctx.tracked_finite)


class NVFP4ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose local GEMM is NVFP4 W4A4 (weight shard [N/tp, K]; amax synced over TP)."""

    def __init__(self, *args, nvfp4: NVFP4Context, **kwargs):
        super().__init__(*args, **kwargs)
        _check_linear(self, type(self).__name__)
        self.nvfp4 = nvfp4
        self.nvfp4_layer_id = 0
        # Upstream all-reduces dgrad inside its GEMM function; ours leaves that to copy_to_..._region's backward.
        self.allreduce_dgrad = False
        self._forward_impl = self._nvfp4_gemm

    def _nvfp4_gemm(self, input, weight, bias, sequence_parallel=False, **_unused):
        if sequence_parallel:  # upstream gathers the sequence inside its GEMM function; so do we
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
        y = _linear(self, input, weight, "out")
        return y + bias if bias is not None else y


class NVFP4RowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose local GEMM is NVFP4 W4A4 (weight shard [N, K/tp]; row/tensor amax synced over TP)."""

    def __init__(self, *args, nvfp4: NVFP4Context, **kwargs):
        super().__init__(*args, **kwargs)
        _check_linear(self, type(self).__name__)
        self.nvfp4 = nvfp4
        self.nvfp4_layer_id = 0
        self._forward_impl = self._nvfp4_gemm

    def _nvfp4_gemm(self, input, weight, bias, **_unused):
        y = _linear(self, input, weight, "in")
        return y + bias if bias is not None else y


class GroupedExperts(MegatronModule):
    """MoE experts for MoELayer: BF16 (`nvfp4=None`) or NVFP4 W4A4 grouped GEMMs; layout in the module docstring."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None,
                 nvfp4: Optional[NVFP4Context] = None):
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("GroupedExperts: expert biases are not supported (set add_bias_linear=False)")
        if pg_collection is not None and pg_collection.expt_tp.size() != 1:
            raise ValueError("GroupedExperts: expert_tensor_parallel_size must be 1 (shard experts with EP)")
        if config.activation_func is not F.silu or not config.gated_linear_unit:
            raise ValueError("GroupedExperts implements SwiGLU experts: activation_func=F.silu, gated_linear_unit")
        self.num_local_experts = num_local_experts
        self.nvfp4 = nvfp4
        self.nvfp4_layer_id = 0
        self.strict = False
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        dtype = config.params_dtype
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, hidden, dtype=dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn, dtype=dtype))
        if config.perform_initialization:
            ep_rank = pg_collection.ep.rank() if pg_collection is not None else 0
            self._init_weights(ep_rank)
        for p in (self.fc1_weight, self.fc2_weight):
            # Megatron's marker for expert parameters: their grads are reduced over the expert-data-parallel group.
            # Always False (GroupedMLP uses `not EP>1`): with TP>1 and expert TP 1 the TP ranks hold replicas that
            # each saw a different slice of the sequence, and only the expert-DP reduction sums them.
            p.allreduce = False

    def _init_weights(self, ep_rank: int) -> None:
        """Initialise all global experts in order and keep this rank's slice: the same model for every EP size
        (Megatron's CPU init of the linears is TP-invariant in the same way).

        With a GPU the draws run there (a 2.6B-parameter model's experts took ~60 s per build on the CPU, on every
        rank): a CUDA generator seeded by one draw of the global CPU generator, which every rank advances alike, so
        the model is still EP-invariant and identical across builds on one machine; its values differ from the CPU
        path's (another generator), which stays as it was."""
        n_local = self.num_local_experts
        n_global = n_local * self.config.expert_model_parallel_size
        mine = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
        methods = (self.config.init_method, self.config.output_layer_init_method)
        with torch.no_grad():
            if gpu_present() and all(_is_normal_init(m) for m in methods):
                g = torch.Generator(device="cuda")
                g.manual_seed(int(torch.randint(0, 2**62, (1,))))
                for w, init in zip((self.fc1_weight, self.fc2_weight), methods):
                    full = torch.empty((n_global,) + tuple(w.shape[1:]), dtype=w.dtype, device="cuda")
                    init(full, generator=g)
                    w.copy_(full[mine])
                return
            full1 = torch.empty((n_global,) + tuple(self.fc1_weight.shape[1:]), dtype=self.fc1_weight.dtype)
            full2 = torch.empty((n_global,) + tuple(self.fc2_weight.shape[1:]), dtype=self.fc2_weight.dtype)
            for e in range(n_global):
                self.config.init_method(full1[e])
                self.config.output_layer_init_method(full2[e])
            self.fc1_weight.copy_(full1[mine])
            self.fc2_weight.copy_(full2[mine])

    def _linear(self, x, weight, counts, salt: int):
        if self.nvfp4 is None:
            return grouped_linear_bf16(x, weight, counts, strict=self.strict)
        ctx = self.nvfp4
        seed = derive_seed(ctx.layer_seed(self.nvfp4_layer_id), salt)
        return nvfp4_grouped_linear(x, weight, counts, ctx.recipe, seed=seed, weight_q=self._weight_q(weight, salt),
                                    backend=ctx.backend, wgrad_sink=ctx.wgrad_sink, finite=ctx.tracked_finite)

    def _weight_q(self, weight: torch.Tensor, salt: int, record: bool = True):
        ctx = self.nvfp4
        # the amax the optimizer's copy took when it wrote the weight, if nothing wrote it since (weight_copy)
        return cached_weight_q(self, weight, lambda: quantize_expert_weights(weight, ctx.recipe, backend=ctx.backend,
                                                                         values=ctx.weight_values,
                                                                         amax=copied_amax(weight, ctx)),
                               slot=f"fc{salt}", record=record)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert, permuted_probs: torch.Tensor):
        # Counts go on as given: a tensor reaches the grouped GEMMs, which read it on the device where they can
        # (torch._grouped_mm in BF16, the NVFP4 Triton kernels, when no backward needs host counts) and on the host
        # otherwise. Megatron's alltoall dispatcher hands them over on the host (0.16.1: moved at its
        # cuda_dtoh_point, waited for at its cuda_sync_point); LocalTokenDispatcher (megatron_patches.moe_dispatch;
        # the embedded engine's and the Learner's at EP = 1) leaves them on the device, so a decode step needs no host
        # synchronisation; so does the NVFP4 train step on the kernels (its wgrad's segments are found from device
        # counts), while a wgrad off them (the reference, a per-expert loop) reads them on the host once, below.
        # (BF16 on the per-expert loops, CPU or the strict learner, reads them on the host: once here, not once per
        # GEMM; strict BF16 without autograd on a GPU reads them on the device: `strict_grouped_applies`; the strict
        # learner's forward on a GPU is that launch too, on a copy of the host counts: `_StrictExperts`.)
        if permuted_hidden.shape[0] == 0:  # this rank's experts got no token (EP): no GEMM runs (torch._grouped_mm's
            out = permuted_hidden * 0        # backward rejects 0 rows on CUDA); zero gradients for the weights, and
            if torch.is_grad_enabled():      # the probs stay in the graph (their dispatch's backward is a collective)
                out = _KeepInGraph.apply(out, permuted_probs, self.fc1_weight, self.fc2_weight)
            return out, None
        # NVFP4 under autograd: a wgrad off the kernels' segment path (a per-expert loop, the reference) needs host
        # counts, read here once for both GEMMs; the kernels' reads them on the device
        counts = tokens_per_expert
        host_wgrad = self.nvfp4 is not None and backward_needs_host_counts(permuted_hidden, self.fc1_weight,
                                                                           self.nvfp4.recipe, self.nvfp4.backend)
        if self.nvfp4 is None and self.strict:  # strict BF16: one launch on device counts where it applies
            on_host = not strict_grouped_applies(permuted_hidden, self.fc1_weight)
        else:
            on_host = host_wgrad or (self.nvfp4 is None and not grouped_mm_applies(permuted_hidden, self.fc1_weight))
        if not torch.is_tensor(counts) or on_host:
            counts = [int(c) for c in (counts.tolist() if torch.is_tensor(counts) else counts)]
        weights = (self.fc1_weight, self.fc2_weight)
        if self.nvfp4 is not None and not _autograd_needed(permuted_hidden, permuted_probs, *weights):
            # forward only (a rollout): FC2's operand in one launch from FC1's output where the kernels apply
            ctx = self.nvfp4
            h = self._linear(permuted_hidden, self.fc1_weight, counts, 1)
            out = nvfp4_swiglu_fc2_forward(h, permuted_probs, self._weight_q(self.fc2_weight, 2), counts, ctx.recipe,
                                           backend=ctx.backend, finite=ctx.tracked_finite,
                                           strict=self.strict)
            return out, None
        out = swiglu_experts(permuted_hidden, permuted_probs, lambda a, i: self._linear(a, weights[i], counts, i + 1),
                             strict=self.strict, amax_hint=self.nvfp4 is not None)
        return out, None


def _autograd_needed(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _KeepInGraph(torch.autograd.Function):
    """y = out, and zero gradients for `params` without reading them (their storage may be released: see
    `release_quantised_weights`), so that every parameter stays in the graph (DDP expects a gradient for each), and
    every tensor whose producer's backward must run (under EP the router probs' dispatch is an all-to-all that every
    rank's backward has to enter)."""

    @staticmethod
    def forward(ctx, out, *params):
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dy):
        return (dy, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


class CacheLayoutError(RuntimeError):
    """A quantised-weight cache could not be updated in place (`quantize_weights_now(in_place=True)`)."""


def _quantised_weights(model: torch.nn.Module):
    """(module, cache slot, parameter, quantise) of every weight an NVFP4 module of `model` quantises; quantise()
    fills the slot as the module's forward would (without recording the weight in the NaN/Inf flag)."""
    for m in model.modules():
        if getattr(m, "nvfp4", None) is None:
            continue
        if isinstance(m, GroupedExperts):
            yield m, "fc1", m.fc1_weight, lambda m=m: m._weight_q(m.fc1_weight, 1, record=False)
            yield m, "fc2", m.fc2_weight, lambda m=m: m._weight_q(m.fc2_weight, 2, record=False)
        elif isinstance(m, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)) and m.weight is not None:
            yield m, "weight", m.weight, lambda m=m: _linear_weight_q(m, m.weight, record=False)


def expert_weights(model: torch.nn.Module) -> list:
    """(parameter, NVFP4Context) of every NVFP4 expert weight stack of `model` (GroupedExperts fc1/fc2): the weights
    whose optimizer copy computes their amax (megatron_patches.weight_copy.install_amax_copy)."""
    return [(p, m.nvfp4) for m in model.modules() if isinstance(m, GroupedExperts) and m.nvfp4 is not None
            for p in (m.fc1_weight, m.fc2_weight)]


def quantize_weights_now(model: torch.nn.Module, *, in_place: bool = False) -> int:
    """Quantise every NVFP4 weight of `model` into its module's cache now, as its next forward would lazily: a rollout
    engine calls this after a weight update, so the update pays the re-quantisation (where it is timed as weight
    sync) and the first rollout step does not. Bits are those of the lazy path (the same cache, the same function).
    The weights are not recorded in the NaN/Inf flag: the caller has just checked them (checked_weight_copy).
    in_place: write the new quantised tensors into the cached ones (same addresses: CUDA graphs captured over the
    caches replay the new weights; a cache made inside a generate holds inference tensors, which refill_in_place
    writes under inference mode); raises CacheLayoutError where a cache cannot be (none yet, or another layout),
    as a graph would then replay the old weights.
    Returns the number of weights quantised; 0 for a BF16 model."""
    n = 0
    for module, slot, _, quantise in _quantised_weights(model):
        name = f"_nvfp4_wq_cache_{slot}"
        old = module.__dict__.get(name)
        new = quantise()
        if in_place and (old is None or old[1] is not new):
            if old is None or not refill_in_place(old[1], new):
                raise CacheLayoutError(f"quantize_weights_now(in_place=True): {type(module).__name__}'s {slot} "
                                       "cache cannot be updated in place (none yet, or another layout)")
            module.__dict__[name] = (module.__dict__[name][0], old[1])
        n += 1
    return n


def release_quantised_weights(model: torch.nn.Module) -> list:
    """Quantise every NVFP4 weight of `model` now and free the storage of the weight itself, keeping its shape: the
    forward and backward of a train step read only the quantised copies (`NVFP4Context.weights_released`), so the
    bf16 weights are dead memory between here and the optimizer's write of new ones (2 B per parameter beside the
    caches' 2.5 B). Only a weight that owns its whole storage and has an fp32 master (`main_param`, set by
    Megatron's mixed-precision optimizer, from which `restore_quantised_weights` can rebuild it) is released.
    A released weight whose cache keeps fp16 block values (the kernels') also drops the cache's packed codes
    (`NVFP4Stack.drop_codes`, `NVFP4Tensor.drop_codes`; 0.5 B per parameter): its GEMMs read the values only (the
    dgrad too, transposed in place); the caches are dropped before the optimizer step (`release_weight_caches`) and
    the next forward quantises again, codes and all.
    Returns [(parameter, storage bytes)] for `restore_quantised_weights`."""
    quantize_weights_now(model)
    released = []
    try:
        for module, slot, p, _ in _quantised_weights(model):
            storage = p.untyped_storage()
            if getattr(p, "main_param", None) is None or p.storage_offset() or \
                    storage.nbytes() != p.numel() * p.element_size():
                continue
            module.nvfp4.weights_released = True
            released.append((p, storage.nbytes()))
            storage.resize_(0)
            cached = module.__dict__[f"_nvfp4_wq_cache_{slot}"][1]
            if isinstance(cached, (NVFP4Stack, NVFP4Tensor)) and cached.values is not None:
                cached.drop_codes()
    except BaseException:  # nothing half-released: the weights released so far come back from their masters
        restore_quantised_weights(model, released, values=True)
        raise
    return released


def restore_quantised_weights(model: torch.nn.Module, released: list, *, values: bool) -> None:
    """Give the released weights their storage back. values: also copy each weight from its fp32 master (the weight
    was bf16(master) when released, Megatron's optimizer keeps that so); without, the contents are undefined until
    the optimizer writes them (a successful step writes every one)."""
    with torch.no_grad():
        for p, nbytes in released:
            p.untyped_storage().resize_(nbytes)
            if values:
                p.copy_(p.main_param)
    for module, *_ in _quantised_weights(model):
        module.nvfp4.weights_released = False
