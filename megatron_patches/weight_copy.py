"""The optimizer's master -> weight copy of the NVFP4 expert weights, with each expert's amax computed on the way
(issue 17): the next re-quantisation of those weights then skips its own amax read.

What it changes in Megatron-Core 0.16.1: after its update, `Float16OptimizerWithFloat16Params.step_with_ready_grads`
calls `_copy_main_params_to_model_params`, which copies every fp32 master into its bf16 model parameter through
`.data` (`_multi_tensor_copy_this_to_that`: `that.copy_(this)` per parameter for bf16). `install_amax_copy` replaces
that method on the Learner's optimizer instances (not the class): the NVFP4 experts' stacks (GroupedExperts
fc1_weight / fc2_weight [E, N, K]) are written by one Triton launch each (minite.kernels.copy_amax: the same bf16
bits as the copy, and max |W_e| of the bf16 values, fp32 [E], bitwise `minite.nvfp4.grouped.stack_amax`), every
other parameter by Megatron's own copy, unchanged.

The amax is kept on the parameter (attribute `minite_copied_amax`) with the key of the weight it was taken from:
(the NVFP4 context and its generation, data_ptr, version counter, shape). `copied_amax` hands it to the quantiser only
while the key still matches: the Learner bumps the generation just before the optimizer step (so the key is that of
the step's write); a later `param.copy_` (a load, `restore_quantised_weights(values=True)`) bumps the version
counter, a write through `.data` comes with `weights_updated()` (the contract of the quantised-weight caches), and
new storage moves data_ptr. A stale or missing amax means the quantiser reads the weight for it as before
(`stack_amax`), so the fused copy changes no bit of anything, only which launch computes the amax.

Where it applies (`fused_copy_applies`): the context's `fuse_weight_amax` is on, the kernels are loaded and the
expert weights quantise on them (`backend` resolves to "triton": on CUDA tensors, or on the CPU under Triton's
interpreter when backend="triton"), the weight recipe has no RHT (its amax would be of the transformed values), and
master and weight are contiguous fp32 / bf16 of one shape. A CPU run on the reference (`minite train` on a CPU)
keeps Megatron's copy for every parameter.
"""
from __future__ import annotations

import logging
import weakref
from typing import Iterable, Optional, Tuple

import torch

from minite.nvfp4.backend import has_kernel, kernel, resolve

log = logging.getLogger(__name__)

STASH = "minite_copied_amax"
"""The parameter attribute holding (amax fp32 [E], key) after a fused copy."""


def _key(weight: torch.Tensor, ctx) -> tuple:
    """What identifies the write that took an amax: the NVFP4 context and its generation (bumped by
    `weights_updated()`, which a write through `.data`, or a `p.data = t` assignment, must come with, as for the
    quantised-weight caches), the storage, the version counter (bumped by `copy_` and other in-place ops) and shape."""
    return (id(ctx), ctx.generation, weight.data_ptr(), weight._version, tuple(weight.shape))


def copied_amax(weight: torch.Tensor, ctx) -> Optional[torch.Tensor]:
    """The per-expert amax that the optimizer's fused copy computed when it last wrote `weight` (fp32 [E]), if
    nothing wrote the weight since (the key matches); None otherwise (the quantiser then reads the weight for it)."""
    found = getattr(weight, STASH, None)
    if found is None or found[1] != _key(weight, ctx):
        return None
    return found[0]


def fused_copy_applies(weight: torch.Tensor, master: torch.Tensor, ctx) -> bool:
    """Whether the fused copy writes `weight` from `master` (see the module docstring)."""
    return (bool(getattr(ctx, "fuse_weight_amax", False)) and has_kernel("copy_amax")
            and not ctx.recipe.weight.rht and resolve(ctx.backend, weight, op="quantize")[0] == "triton"
            and weight.dtype == torch.bfloat16 and master.dtype == torch.float32 and weight.shape == master.shape
            and weight.dim() == 3 and weight.device == master.device
            and weight.is_contiguous() and master.is_contiguous()
            # the weight's storage is there (not released for the step's forward and backward)
            and weight.untyped_storage().nbytes() >= weight.numel() * weight.element_size())


def copy_with_amax(weight: torch.Tensor, master: torch.Tensor, ctx) -> torch.Tensor:
    """weight <- bf16(master) and its per-expert amax, kept on the weight for `copied_amax`; returns the amax.
    `weight` is the parameter itself (not `.data`, a new tensor with a version counter of its own each time)."""
    amax = kernel("copy_amax")(master.detach(), weight.detach())
    setattr(weight, STASH, (amax, _key(weight, ctx)))
    return amax


def _fused_copy(opt_ref, experts: dict):
    """The replacement of one optimizer's `_copy_main_params_to_model_params` (Float16OptimizerWithFloat16Params in
    Megatron-Core 0.16.1): the expert stacks through `copy_with_amax` where it applies, the rest as upstream."""
    from megatron.core.optimizer.optimizer import _multi_tensor_copy_this_to_that

    def copy_main_params_to_model_params():
        opt = opt_ref()
        model_data, main_data, fused = [], [], []
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for param, main in zip(model_group, main_group):
                hit = experts.get(id(param))
                if hit is not None and hit[0] is param and fused_copy_applies(param, main, hit[1]):
                    fused.append((param, main, hit[1]))
                    continue
                if hasattr(param, STASH):  # written by the copy below: any earlier amax is stale
                    delattr(param, STASH)
                model_data.append(param.data)
                main_data.append(main.data)
        _multi_tensor_copy_this_to_that(this=main_data, that=model_data, overflow_buf=opt._dummy_overflow_buf)
        for param, main, ctx in fused:
            copy_with_amax(param, main, ctx)

    return copy_main_params_to_model_params


def install_amax_copy(optimizer, weights: Iterable[Tuple[torch.nn.Parameter, object]]) -> int:
    """Replace `_copy_main_params_to_model_params` on every mixed-precision optimizer inside `optimizer` (a
    ChainedOptimizer or one optimizer) that holds one of `weights` ((expert weight parameter, its NVFP4Context)
    pairs, megatron_patches.nvfp4_layers.expert_weights); idempotent. Returns how many optimizers were patched."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    experts = {id(p): (p, ctx) for p, ctx in weights}
    patched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, Float16OptimizerWithFloat16Params) or getattr(opt, "is_stub_optimizer", True):
            continue
        mine = {k: v for k, v in experts.items()
                if any(p is v[0] for group in opt.float16_groups for p in group)}
        if not mine:
            continue
        # a weak reference: the function lives in the optimizer's __dict__, and a strong one would make a cycle
        opt._copy_main_params_to_model_params = _fused_copy(weakref.ref(opt), mine)
        patched += 1
    if patched:
        log.debug("weight_copy: the expert weights' master copy computes their amax (%d optimizer(s))", patched)
    return patched
