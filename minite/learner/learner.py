"""The Learner: a Megatron-Core Qwen3-MoE (BF16 or NVFP4 W4A4) with Adam, grad clipping and token log-probs.

One train step is Megatron's own machinery without its pipeline schedule (pipeline parallelism is 1):
    zero grad buffers -> logp = log_softmax(fp32 logits)[targets] of this rank's rows, all-gathered over data
    parallelism -> loss_fn(logp of the whole batch) -> backward
    -> finalize_model_grads (DDP all-reduce over data/expert-data ranks; q/k-norm and sequence-parallel norm
       grads over TP ranks) -> MegatronOptimizer.step
       (fp32 master weights when compute is BF16; global grad-norm clip that counts every TP/EP shard once)
Log-probs: logp[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) from fp32 logits; with TP the vocabulary is
sharded and Megatron's vocab_parallel_cross_entropy computes the same quantity without gathering the logits.

Data parallelism: the batch's rows are split over Megatron's data-parallel group (`local_rows`): DP rank r of D
forwards rows [r B/D, (r+1) B/D); the TP ranks of one replica see the same rows (sequence parallelism splits T
among them), and under EP the token all-to-all carries each rank's own tokens to the experts. B must be a multiple
of D (ValueError otherwise: padding rows would cost a forward and need routing-replay targets of their own).
The loss stays global: the local log-probs are all-gathered over DP (`_GatherRows`), so loss_fn still receives
the whole batch's [B, T-1] log-probs and computes the same loss, token means and metrics as an unsharded run;
only the forward and backward are split. Gradient invariant: every DP rank evaluates the identical loss L on the
identical gathered log-probs; the gather's backward sums the D upstream gradients (all-reduce), so rank r
back-propagates D * dL/dlogp[its rows]; DDP then multiplies by 1/D and sums over DP (experts: 1/D over their
expert-data group, which with the all-to-all covers every token once), which gives sum_r dL/dtheta|rows r =
dL/dtheta of the full batch. Cost of the gather: B x (T-1) fp32 forward and backward, against a model forward.
BF16 (and fp32) results equal the unsharded run's up to the order of the cross-rank fp32 sums. NVFP4: the forward
is per row (row-scoped activation scales) and equal too, but quantisers scoped along the token dim (wgrad
operands) and stochastic rounding see this rank's tokens only, so NVFP4 gradients carry other rounding noise than
an unsharded run, as with any split of the batch into micro-batches.

NVFP4 memory: for the forward and backward of a step the quantised weights are all the model reads of its NVFP4
layers, so the bf16 weights' storage is freed after they are quantised and given back before the optimizer step,
which writes every one from its fp32 master (a skipped step or a failing loss rebuilds them from the masters).
The optimizer's copy of the expert weights from their masters also takes each expert's amax, which their next
quantisation uses instead of reading the weights for it (megatron_patches.weight_copy: one launch per weight stack
instead of the copy and the amax read, the same bits; on the kernels only).

Resume: `state_dict()` snapshots model weights, optimizer state (fp32 masters, Adam moments and step), the step
counter that seeds NVFP4 stochastic rounding, and torch's CPU RNG; `load_state_dict` restores all of them, so a
resumed run repeats an uninterrupted run bit for bit.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Dict, Iterable, Iterator, Protocol, Tuple

import torch

from minite.config import Config
from minite.convert.hf_megatron import load_into_model
from minite.console import CONSOLE
from minite.learner.model import build_model, compute_dtype, nvfp4_context
from minite.learner.weights import checked_weight_copy
from minite.megatron_patches.cpu import cuda_as_cpu
from minite.megatron_patches.grad_stats import count_experts_by_expert_tp
from minite.megatron_patches.moe_dispatch import detach_dispatcher_graphs, use_local_dispatch
from minite.megatron_patches.nvfp4_layers import (expert_weights, release_quantised_weights, release_weight_caches,
                                                   restore_quantised_weights)
from minite.megatron_patches.weight_copy import install_amax_copy
from minite.nvfp4.device_copy import host_to
from minite.ops.grouped import DeferredWgrads, mark_main_grads_zeroed
from minite.ops.logprobs import lse_applies, logprobs_at, row_logsumexp
from minite.strict import ops as strict_ops

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor], Tuple[torch.Tensor, Dict[str, float]]]


def _snapshot(obj, device=None):
    """A deep copy with every tensor cloned (Megatron's state dicts hold live references), onto `device` if given."""
    if torch.is_tensor(obj):
        return obj.detach().clone() if device is None else obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v, device) for v in obj)
    return copy.deepcopy(obj)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
    """logits [B, T, V/tp] (vocab-parallel), tokens [B, T] -> logp [B, T-1] in fp32 (autograd-aware).
    strict: the batch-invariant log-softmax of minite.strict.ops (alignment.strict; TP = 1). Default mode without a
    gradient on a GPU (TP = 1): logit - the log-sum-exp of the rollout sampler's pass (minite.ops.logprobs), the
    rollout's own log-probs where the logits are the same."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits[:, :-1].to(torch.float32, copy=True)  # contiguous, and ours: the TP path works in place
    target = host_to(tokens, logits.device)[:, 1:]  # no copy when the caller moved them (Learner._logits)
    if ps.get_tensor_model_parallel_world_size() == 1:
        if strict:  # the log-softmax at the targets only (the same bits; under autograd too, ops._StrictForward)
            return strict_ops.token_log_softmax(logits.view(-1, logits.shape[-1]), target.reshape(-1)).view(
                target.shape)
        flat = logits.view(-1, logits.shape[-1])  # the fp32 copy above: contiguous
        if not logits.requires_grad and lse_applies(flat):
            return logprobs_at(flat, target.reshape(-1), row_logsumexp(flat)).view(target.shape)
        return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return -vocab_parallel_cross_entropy(logits, target)


def _read_scalars(values: list) -> list:
    """Python floats of scalars (floats, or tensors anywhere), the tensors read in one host copy (one wait for the
    device instead of one a value). A tensor's float is its value in fp64, as float(tensor) gives it."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.reshape(()).to(tensors[0].device, torch.float64) for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


def _all_gather(t: torch.Tensor, size: int, group) -> list:
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


class _GatherRows(torch.autograd.Function):
    """Forward: concatenate the equal row blocks of the data-parallel ranks (in rank order).
    Backward: sum the whole-batch gradient over the ranks (each evaluated its own copy of the loss) and keep this
    rank's block; see the module docstring for why DDP's 1/D average then yields the full-batch gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.block = group, slice(rank * local.shape[0], (rank + 1) * local.shape[0])
        return torch.cat(_all_gather(local.contiguous(), size, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.block], None, None, None


def _adam_implementation(optimizer) -> None:
    """torch's fused AdamW kernel for parameter groups on CUDA; torch's default (single-tensor loop on the CPU)
    elsewhere, as Megatron built it.

    Without transformer-engine or apex, Megatron-Core 0.16.1 builds torch.optim.AdamW (torch.optim.Adam when weight
    decay is not decoupled) with torch's default implementation: on CUDA the foreach one, a dozen multi-tensor
    launches per step plus an fp32 temporary (sqrt of the second moment) the size of each group. The fused kernel
    does one pass with no temporary. Applied again after a checkpoint load, whose parameter groups carry the
    implementation flags of the run that saved them; the state's layout (exp_avg, exp_avg_sq, step) is the same."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if not (group["params"] and all(p.is_cuda for p in group["params"])):
                group.update(fused=None, foreach=None)
                continue
            group.update(fused=True, foreach=False)
            for p in group["params"]:  # the fused kernel keeps `step` on the device, as torch's own load does
                state = inner.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


class Learner:
    """Owns the model, its DDP wrapper and optimizer; see the module docstring for the step."""

    def __init__(self, cfg: Config, *, frozen: bool = False):
        """frozen: no DDP wrapper and no optimizer (the KL reference policy: log-probs and weight loads only)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.cfg = cfg
        self.strict = bool(cfg.alignment.strict)
        self.model = build_model(cfg, strict=self.strict)
        # EP = 1: MoE layers dispatch locally (Megatron's rows and bits, without its three host synchronisations and
        # E-way split/cat per layer); other layouts keep Megatron's dispatcher (megatron_patches.moe_dispatch)
        self.local_moe_layers = use_local_dispatch(self.model)
        if cfg.model.init_from:
            # before the optimizer exists: it copies fp32 master weights from the model at construction
            load_into_model(self.model, cfg.model.init_from)
            if torch.distributed.get_rank() == 0:  # one confirmation on the terminal, not one per rank
                logger.info("initial weights loaded from %s", cfg.model.init_from, extra=CONSOLE)
        self.nvfp4 = nvfp4_context(self.model)
        self.step = 0
        self.ddp = self.optimizer = None
        if frozen:
            for p in self.model.parameters():
                p.requires_grad_(False)
            return
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False, bucket_size=None)
        with cuda_as_cpu():
            self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model)
            self.optimizer = self._build_optimizer()

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.optim
        bf16 = compute_dtype(self.cfg) == torch.bfloat16
        config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=False,
        )
        optimizer = get_megatron_optimizer(config, [self.ddp])
        count_experts_by_expert_tp(optimizer)  # one grad norm on every TP rank (megatron_patches/grad_stats.py)
        _adam_implementation(optimizer)
        if self.nvfp4 is not None:  # the expert weights' copy from their masters also takes their amax
            install_amax_copy(optimizer, expert_weights(self.model))
        return optimizer

    # ------------------------------------------------------------------ forward
    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[1] < 2:
            raise ValueError(f"tokens need at least 2 positions to score, got T={tokens.shape[1]}")
        tokens = host_to(tokens, self.model.embedding.word_embeddings.weight.device)  # without a synchronisation
        t = tokens.shape[1]
        padded, _, _ = self.sequence_shard(t)
        if padded > t:  # causal: the pads are inert
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], padded - t)], dim=1)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return (self.ddp or self.model)(tokens, positions, None)[:, :t]

    def sequence_shard(self, seq_len: int) -> tuple[int, int, int]:
        """(padded length, first, end) of the positions this rank's layers between the embedding and the output
        layer hold in a forward over `seq_len` positions: (seq_len, 0, seq_len) without sequence parallelism; with it
        (TP > 1; `minite diagnose` turns it off) seq_len padded to a multiple of TP and this TP rank's slice. The
        routers see those positions (a routing replay's targets are sliced to them)."""
        from megatron.core import parallel_state as ps
        tp = self.cfg.parallel.tp
        if tp == 1 or not self.model.config.sequence_parallel:
            return seq_len, 0, seq_len
        padded = seq_len + (-seq_len) % tp
        per, rank = padded // tp, ps.get_tensor_model_parallel_rank()
        return padded, rank * per, (rank + 1) * per

    def local_rows(self, batch_size: int) -> range:
        """The rows of a [batch_size, T] batch that this rank forwards: its data-parallel rank's contiguous block
        (all rows when data parallelism is 1). ValueError when batch_size is not a multiple of the DP size."""
        from megatron.core import parallel_state as ps
        size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if batch_size < 1 or batch_size % size:
            raise ValueError(f"a batch of {batch_size} rows does not split over {size} data-parallel ranks: make "
                             f"the rows of each forward (rl.prompts_per_step x rollout.group_size, over "
                             f"rl.minibatches and rl.micro_batches) a multiple of {size} (world size / "
                             f"(parallel.tp x parallel.pp))")
        block = batch_size // size
        return range(rank * block, (rank + 1) * block)

    def _batch_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs [B, T-1] of the whole batch: this rank's rows forwarded, the rest all-gathered over DP."""
        from megatron.core import parallel_state as ps
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be a LongTensor [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
        rows = self.local_rows(tokens.shape[0])
        mine = host_to(tokens[rows.start:rows.stop], self.model.embedding.word_embeddings.weight.device)
        logp = token_logprobs(self._logits(mine), mine, strict=self.strict)
        size = ps.get_data_parallel_world_size()
        if size == 1:
            return logp
        return _GatherRows.apply(logp, ps.get_data_parallel_group(), ps.get_data_parallel_rank(), size)

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as fp32 [B, T-1] (no grad; eval mode; rows split over DP)."""
        self.model.eval()
        try:
            return self._batch_logprobs(tokens)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ train
    def train_step(self, tokens: torch.Tensor, loss_fn: LossFn, *, micro_batches: int = 1) -> Dict[str, float]:
        """Forward, loss_fn(logp [B, T-1] with grad) -> (loss, metrics), backward, clip, Adam step, zero grad.

        Collective over all ranks, each passing the same whole batch: each forwards its `local_rows`, loss_fn sees
        the whole batch's log-probs (gathered), so its loss and metrics are the global ones on every rank.
        micro_batches: gradient accumulation. The B rows split into that many consecutive chunks of B/micro_batches
        rows (a multiple of the data-parallel size), forwarded and back-propagated one after another, so only one
        chunk's activations are alive at a time; loss_fn is called once per chunk, with that chunk's log-probs, and
        returns the chunk's share of the loss (the gradients add up: e.g. its token sum / all tokens); one optimizer
        step follows. Reported: the loss summed over chunks, each metric averaged over them."""
        from megatron.core.distributed import finalize_model_grads
        if micro_batches < 1 or tokens.shape[0] % micro_batches:
            raise ValueError(f"micro_batches={micro_batches} must be >= 1 and divide the {tokens.shape[0]} rows")
        self.model.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        rows, total, sums = tokens.shape[0] // micro_batches, None, {}
        # NVFP4: the forward and backward read only the quantised weights; the bf16 ones are freed until the step
        released = release_quantised_weights(self.model) if self.nvfp4 is not None else []
        # NVFP4 with accumulation: the experts' wgrads wait, up to expert_wgrad_passes micro-batches, and are added
        # into main_grad in one launch per weight (the same bits; minite.ops.grouped.DeferredWgrads)
        passes = min(micro_batches, self.nvfp4.expert_wgrad_passes) if self.nvfp4 is not None else 1
        sink = DeferredWgrads(self.nvfp4.backend, passes) if passes > 1 else None
        if self.nvfp4 is not None:
            self.nvfp4.wgrad_sink = sink
        # NVFP4: the first expert wgrad of the step writes each main_grad instead of adding to its zeros (cleared below)
        zeroed = list(self.model.parameters()) if self.nvfp4 is not None else []
        mark_main_grads_zeroed(zeroed)
        try:
            for i in range(micro_batches):
                if self.nvfp4 is not None:
                    self.nvfp4.micro_batch = i  # each chunk its own stochastic rounding (NVFP4Context.layer_seed)
                loss, metrics = loss_fn(self._batch_logprobs(tokens[i * rows:(i + 1) * rows]))
                if not torch.is_tensor(loss) or loss.dim() != 0:
                    raise ValueError("loss_fn must return (a scalar loss tensor, a metrics dict)")
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
                for k, v in (metrics or {}).items():  # summed where they are: read once, after the step (below)
                    sums[k] = sums.get(k, 0.0) + (v.detach().double() if torch.is_tensor(v) else float(v))
                del loss  # with the dispatchers' tensors, the last references to this chunk's graph (below)
            if sink is not None:
                sink.flush()
        except BaseException:  # the weights back from their masters
            restore_quantised_weights(self.model, released, values=True)
            raise
        finally:  # a failing loss_fn must not leave a later step on another chunk's seeds
            # the backward graph's functions keep their context attributes (NVFP4: every layer's quantised weights)
            # while anything references the graph: the loss (dropped above) and Megatron's token dispatchers
            detach_dispatcher_graphs(self.model)
            if self.nvfp4 is not None:
                mark_main_grads_zeroed(zeroed, False)  # what no wgrad wrote keeps its zeros, but say nothing more
                self.nvfp4.micro_batch = 0
                self.nvfp4.wgrad_sink = None
                if sink is not None:
                    sink.clear()  # a failed step's pending operands
                release_weight_caches(self.model)  # stale after the step: not held while the optimizer's memory peaks
        restore_quantised_weights(self.model, released, values=False)  # the step writes every one of them
        ok = False
        if self.nvfp4 is not None:
            # the optimizer writes the weights through .data: cached quantised weights are stale from here on. Bumped
            # before the step, so that the expert amaxes its copy takes (megatron_patches.weight_copy) carry the
            # generation the next quantisation sees
            self.nvfp4.weights_updated()
        try:
            with cuda_as_cpu():
                finalize_model_grads([self.ddp])
                ok, grad_norm, _ = self.optimizer.step()
        finally:
            if not ok:  # a skipped step wrote no weight, a failing one maybe not all: back from their masters
                restore_quantised_weights(self.model, released, values=True)
        if not ok:
            logger.warning("optimizer step skipped (non-finite gradients) at step %d", self.step)
        # the gradient buffers are zeroed once, at the next step's start (a second zeroing here wrote every fp32
        # main_grad again: 2.8 ms of the H200 learner slice's step)
        self.optimizer.zero_grad()
        self.step += 1
        if self.nvfp4 is not None:
            self.nvfp4.step = self.step
        read = _read_scalars(list(sums.values()) + [total])
        out = {k: v / micro_batches for k, v in zip(sums, read)}
        out.update(loss=read[-1], grad_norm=float(grad_norm if grad_norm is not None else 0.0),
                   step_ok=float(bool(ok)))
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """A snapshot of model, optimizer, step counter and CPU RNG, for atomic checkpoints: every tensor copied to
        the CPU (a checkpoint goes there anyway; cloned on the GPU, the fp32 masters, Adam's moments and the weights
        took ~14 B per parameter of GPU memory at each save: the H200 example's 2.57B parameters ran out of an
        H100's 80 GB at its final checkpoint)."""
        return {
            "model": _snapshot(self.model.state_dict(), "cpu"),
            "optimizer": _snapshot(self.optimizer.state_dict(), "cpu"),
            "step": self.step,
            "rng_cpu": torch.get_rng_state(),
            "precision": self.cfg.precision.mode,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore a `state_dict()`; a clear ValueError when it does not fit this learner."""
        missing = {"model", "optimizer", "step"} - set(sd) if isinstance(sd, dict) else {"<not a dict>"}
        if missing:
            raise ValueError(f"learner state dict is missing {sorted(missing)}")
        if sd.get("precision", self.cfg.precision.mode) != self.cfg.precision.mode:
            raise ValueError(f"checkpoint precision {sd['precision']!r} != config precision "
                             f"{self.cfg.precision.mode!r}")
        try:
            self.model.load_state_dict(sd["model"], strict=True)
        except RuntimeError as e:
            raise ValueError(f"checkpoint does not match the model: {e}") from e
        with cuda_as_cpu():
            self.optimizer.load_state_dict(_snapshot(sd["optimizer"]))
        self._apply_optim_config()
        self.step = int(sd["step"])
        if self.nvfp4 is not None:
            self.nvfp4.step = self.step
            self.nvfp4.weights_updated()
        if "rng_cpu" in sd:
            torch.set_rng_state(sd["rng_cpu"])

    def close(self) -> None:
        """Release the model, DDP wrapper and optimizer (and their memory) once the last reference goes.

        Megatron's DDP registers a backward hook on every parameter's grad-accumulator node, and the hook's closure
        holds the DDP object, which holds the model; the nodes stay alive through `ddp.grad_accs` and through the
        last forward's autograd graph (the MoE token dispatcher keeps its routing probabilities as attributes). That
        cycle runs through C++ autograd nodes, which Python's garbage collector cannot see, so without this a
        deleted Learner keeps its parameters, fp32 gradient buffers and (through `param.main_param`) the optimizer's
        fp32 master weights alive: 10 bytes per parameter (tools/bench/learner_memory.py --leak). Here the hooks
        are removed from the nodes (a node's hooks live in one dict, reachable through the handle of a new hook).
        The learner is unusable afterwards."""
        if self.ddp is not None:
            for node in self.ddp.grad_accs:
                hooks = node.register_hook(lambda *_: None).hooks_dict_ref()
                if hooks is not None:
                    hooks.clear()
            self.ddp.grad_accs.clear()
        self.ddp = self.optimizer = None

    def load_weights(self, named: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy (Megatron parameter name, tensor) pairs, as `named_weights()` yields them, into this model, checked
        first (minite.learner.weights.checked_weight_copy: WeightUpdateError, nothing half-copied)."""
        checked_weight_copy(dict(self.model.named_parameters()), named)
        if self.optimizer is not None:  # its fp32 masters too: the next step writes the masters into the weights
            with cuda_as_cpu():
                self.optimizer.reload_model_params()
        if self.nvfp4 is not None:
            self.nvfp4.weights_updated()

    def _apply_optim_config(self) -> None:
        """cfg.optim's hyperparameters into every param group: a loaded optimizer state carries the groups of the
        run that saved it, and a resumed run follows its current config (minite.rl.resume_policy). Clipping is read
        from the optimizer's config, which is already the current one."""
        o = self.cfg.optim
        for g in self.optimizer.param_groups:
            g.update(lr=o.lr * g.get("lr_mult", 1.0), max_lr=o.lr, min_lr=o.lr,
                     weight_decay=o.weight_decay * g.get("wd_mult", 1.0), betas=(o.adam_beta1, o.adam_beta2),
                     eps=o.adam_eps)
        _adam_implementation(self.optimizer)

    def named_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(Megatron parameter name, tensor) for rollout weight sync: this rank's shard, compute dtype, no grad."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def full_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Like named_weights, but every tensor gathered to its unsharded (TP=1, EP=1) layout on every rank.

        TP shards concatenate along Megatron's partition_dim; a gated (SwiGLU) column-parallel fc1 holds
        [gate_r; up_r] per rank and is reordered to [gate; up]. Expert shards concatenate along the expert dim.
        Collective: every rank of the TP/EP groups must call it (with world size 1 it is named_weights)."""
        from megatron.core import parallel_state as ps
        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        for name, p in self.model.named_parameters():
            t = p.detach().contiguous()
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                parts = _all_gather(t, tp, ps.get_tensor_model_parallel_group())
                if name.endswith("linear_fc1.weight") and self.model.config.gated_linear_unit:
                    halves = [x.chunk(2, dim=0) for x in parts]
                    parts = [h[0] for h in halves] + [h[1] for h in halves]
                t = torch.cat(parts, dim=p.partition_dim)
            elif not getattr(p, "allreduce", True) and ep > 1:
                t = torch.cat(_all_gather(t, ep, ps.get_expert_model_parallel_group()), dim=0)
            yield name, t


class ReferencePolicy(Protocol):
    """The frozen policy of the KL penalty, whatever the rollout backend: log-probs of token rows as the learner
    computes them, and weights from / to (Megatron name, tensor) pairs."""

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, named: Iterable[Tuple[str, torch.Tensor]]) -> None: ...

    def named_weights(self) -> Iterator[Tuple[str, torch.Tensor]]: ...


def reference_policy(cfg: Config) -> ReferencePolicy:
    """A frozen copy of the learner's model (same layers, parallel layout and log-prob computation)."""
    return Learner(cfg, frozen=True)
