"""Megatron-Core on CPU: the small adaptations that let a Megatron GPTModel train with gloo.

What, why, which versions
-------------------------
Supported upstream: megatron-core 0.16.1 exactly (the version setup.py pins; the newest for Python 3.11).
Megatron-Core assumes a GPU in a handful of places. Each patch below replaces one such place with
its CPU meaning and nothing more; numerics are untouched. Apply with `apply()`: it is idempotent,
does nothing when a GPU is present (unless `force=True`), and logs each patch it makes. Each patch is
exercised against the real upstream classes by tests/learner/ and tests/megatron_patches/ and the distributed tests (marker distributed)
(the dispatcher patch by EP=2 under torchrun).

| upstream place (0.16.1)                                     | on CPU it ...                       | patch                                         |
|-------------------------------------------------------------|-------------------------------------|-----------------------------------------------|
| `torch.cuda.current_device()` as a `device=` argument         | raises (no CUDA in the build)        | returns "cpu"                                  |
| `CudaRNGStatesTracker.add/fork` (tensor_parallel/random.py)   | calls torch.cuda RNG functions       | the tracked states live in CPU generators      |
| `moe_utils.te_general_gemm` (a 0.16.1 bug: unset without TE)  | NameError in the router GEMM (on GPUs too) | defined as None (router falls back to torch); `apply_upstream_fixes()`, on every device |
| `clip_grads.l2_norm_impl` = `utils.local_multi_tensor_l2_norm` (the fallback without TE or apex) | reads every gradient's norm back to the host, one synchronisation each (41 per step of the H200 learner slice) | the same norms gathered on the device, one read back, the same bits; `apply_upstream_fixes()`, on every device |
| `clip_grads.multi_tensor_scale_impl`, `optimizer.multi_tensor_scale_impl` = `utils.local_multi_tensor_scale` | clips the gradients through a full-size temporary and a copy back (`dst.copy_(src * scale)`); copies fp16 weights through one (`* 1.0`) | an in-place `mul_` of each gradient, a plain copy at scale 1.0, the same bits; `apply_upstream_fixes()`, on every device |
| `grouped_gemm_util.ops.gmm` (legacy GroupedMLP)               | needs the grouped_gemm CUDA package  | a per-expert torch.matmul fallback             |
| `MoEAlltoAllTokenDispatcher` streams and device->host copies  | creates torch.cuda.Stream; gloo gets tensors as split sizes | no streams; split sizes become numpy arrays |
| `transformer.utils.get_default_causal_mask` / sliding window  | hard-codes device="cuda"             | same masks on the CPU                          |
| DDP, grad buffers, optimizers, clip_grads, finalize_model_grads (literal "cuda", `param.type() == 'torch.cuda.FloatTensor'` checks) | raise | `cuda_as_cpu()` context: a TorchFunctionMode mapping cuda->cpu |

The last row is a context manager, not a global patch: a TorchFunctionMode costs a Python call per
torch op, so the learner enters it only around DDP/optimizer construction, grad finalisation and the
optimizer step (a few hundred ops), never around the forward/backward. Inside it: `device="cuda"`/`"cuda:N"`/int
device arguments become "cpu", `Tensor.cuda()` is the identity, and `Tensor.type()` (no argument)
reports "torch.cuda.<T>" so Megatron's dtype dispatch (Float16OptimizerWithFloat16Params,
clip_grads) takes its CUDA branch with CPU tensors.

TORCHDYNAMO_DISABLE=1 is recommended on CPU (Megatron's jit_fuser is torch.compile); it is an
environment variable, so launchers set it, not this module.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, List

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_CORE = ("0.16.1",)
_APPLIED: List[str] = []


def gpu_present() -> bool:
    """True when torch sees a CUDA device; the patches are then not needed."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


# ---------------------------------------------------------------------------------------------
# cuda -> cpu TorchFunctionMode (scoped)
# ---------------------------------------------------------------------------------------------
def _cpu_device(dev: Any) -> Any:
    if isinstance(dev, int) and not isinstance(dev, bool):
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


class CudaAsCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to the CPU and reports CPU tensors with CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu():
    """Run Megatron code with literal "cuda" devices/type checks on the CPU (no-op with a GPU)."""
    if gpu_present():
        yield
        return
    with CudaAsCpuMode():
        yield


# ---------------------------------------------------------------------------------------------
# individual patches; each returns a one-line description for the log
# ---------------------------------------------------------------------------------------------
def _patch_current_device() -> str:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    return "torch.cuda.current_device() -> 'cpu'"


def _patch_rng_tracker() -> str:
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    return "CudaRNGStatesTracker.add/fork and _get/_set_cuda_rng_state use the CPU generator"


def _patch_te_general_gemm() -> str:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        return "moe_utils.te_general_gemm = None (0.16.1 leaves it undefined without TE)"
    return ""


def _torch_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm.ops.gmm semantics: rows of `a` grouped by expert; b is [E, K, N] (or [E, N, K])."""
    outs = []
    start = 0
    for e, n in enumerate(torch.as_tensor(batch_sizes).tolist()):
        w = b[e].t() if trans_b else b[e]
        outs.append(a[start:start + n] @ w)
        start += n
    return torch.cat(outs, dim=0) if outs else a.new_zeros(0, b.shape[-2 if trans_b else -1])


def _patch_grouped_gemm() -> str:
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm_is_available():
        return ""

    class _Ops:
        gmm = staticmethod(_torch_gmm)

    gg.ops = _Ops()
    gg.grouped_gemm_is_available = lambda: True
    gg.assert_grouped_gemm_is_available = lambda: None
    return "grouped_gemm_util.ops.gmm -> per-expert torch.matmul (legacy GroupedMLP)"


def _as_numpy(x):
    return x.cpu().numpy() if torch.is_tensor(x) else x


def _patch_alltoall_dispatcher() -> str:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    D.cuda_dtoh_stream = "cpu-no-stream"  # any non-None value: __init__ then skips torch.cuda.Stream()

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # Same values as upstream, no streams; gloo's all_to_all_single wants host split sizes
        # (upstream's maybe_move_tensor_to_cpu skips the numpy conversion for CPU tensors).
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            if torch.is_tensor(tokens_per_expert):
                tokens_per_expert = tokens_per_expert.cpu()
            self.input_splits = _as_numpy(self.input_splits)
            self.output_splits = _as_numpy(self.output_splits)
            self.output_splits_tp = _as_numpy(self.output_splits_tp)
            if torch.is_tensor(self.num_out_tokens):
                self.num_out_tokens = self.num_out_tokens.cpu()
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = self.num_global_tokens_per_local_expert.cpu()
        return tokens_per_expert

    D._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    return "MoEAlltoAllTokenDispatcher: no CUDA streams, split sizes as numpy arrays (as upstream on GPU)"


def _patch_causal_masks() -> str:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def get_sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = get_default_causal_mask
        mod.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    return "get_default_causal_mask / get_sliding_window_causal_mask build on the CPU"


def _gathered_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`local_multi_tensor_l2_norm` (megatron.core.utils, 0.16.1) with its norms gathered on the device: upstream
    builds `torch.tensor(norms)` from the per-tensor device norms, a host read (and a stream synchronisation) per
    gradient. Here they are stacked and read back once; the total is the same CPU fp32 norm of the same values
    (so the same bits), copied back without a second synchronisation. Returns ([total] fp32 on the grads' device,
    None), as upstream."""
    from minite.nvfp4.device_copy import host_to

    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    dev = norms[0].device if norms else torch.device("cpu")
    total = torch.norm(torch.stack(norms).cpu() if norms else torch.zeros(0))
    return host_to(torch.tensor([float(total)], dtype=torch.float), dev), None


def _patch_local_l2_norm() -> str:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if getattr(clip_grads, "l2_norm_impl", None) is not utils.local_multi_tensor_l2_norm:
        return ""  # TE's or apex's multi-tensor kernel, or patched already
    clip_grads.l2_norm_impl = _gathered_l2_norm
    return "clip_grads.l2_norm_impl: the local fallback's norms gathered on the device (one host read, not one each)"


def _scale_without_temporary(chunk_size, noop_flag, tensor_lists, scale):
    """`local_multi_tensor_scale` (megatron.core.utils, 0.16.1: `dst.copy_(src * scale)` for each pair) without its
    full-size temporary. clip_grads scales the fp32 gradients onto themselves whenever it clips: an in-place `mul_`
    per gradient here (torch's multiply by the same scalar, in place: the same products), where upstream's fallback
    wrote each product to a new tensor and copied it back (on the H200 learner slice's one-sequence step, which
    clips every step: a 5.9 ms multiply and a 5.9 ms device-to-device copy at ce3ee2b; `torch._foreach_mul_`, tried
    first, took 6.8 ms for the multiply alone; session 19, docs/benchmarks.md). Scale 1.0 (Megatron's copies
    between masters and weights when it passes an overflow buffer, i.e. fp16 runs; bf16 runs copy directly) is a
    plain `copy_`: x * 1.0 is x (signed zeros, subnormals and infinities included; a NaN stays a NaN, its payload
    may differ). Other calls (a tensor scale, distinct lists) as upstream. noop_flag is not touched, as upstream's
    fallback does not."""
    src, dst = tensor_lists
    if not torch.is_tensor(scale) and scale == 1.0:
        for s, d in zip(src, dst):
            d.copy_(s)
    elif not torch.is_tensor(scale) and len(src) == len(dst) and all(s is d for s, d in zip(src, dst)):
        for d in dst:
            d.mul_(scale)
    else:
        for s, d in zip(src, dst):
            d.copy_(s * scale)


def _patch_local_scale() -> str:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    patched = []
    for mod in (optimizer, clip_grads):
        if getattr(mod, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = _scale_without_temporary
            patched.append(mod.__name__.rsplit(".", 1)[-1])
    if not patched:
        return ""  # TE's or apex's multi-tensor kernel, or patched already
    return (f"{' and '.join(patched)}.multi_tensor_scale_impl: the local fallback without its fp32 temporary "
            "(a copy at scale 1.0, an in-place multiply onto itself)")


# Upstream bugs that bite on every device: apply_upstream_fixes() runs them with or without a GPU.
_UPSTREAM_FIXES: List[Callable[[], str]] = [_patch_te_general_gemm, _patch_local_l2_norm, _patch_local_scale]


def _run_patches(patches: List[Callable[[], str]], applied: List[str], prefix: str) -> None:
    """Run each patch once, logging and recording what it changed (a patch returns "" when nothing was needed)."""
    for patch in patches:
        what = patch()
        if what:
            logger.info("%s: %s", prefix, what)
            applied.append(what)


def apply_upstream_fixes() -> List[str]:
    """Fix the device-independent 0.16.1 bugs (first found on the H200: the router's te_general_gemm NameError).

    Idempotent (each fix checks whether it is needed); returns what was fixed. `apply()` calls it too.
    """
    fixed: List[str] = []
    _run_patches(_UPSTREAM_FIXES, fixed, "megatron_patches")
    return fixed


_PATCHES: List[Callable[[], str]] = [
    _patch_current_device,
    _patch_rng_tracker,
    _patch_grouped_gemm,
    _patch_alltoall_dispatcher,
    _patch_causal_masks,
]


def apply(force: bool = False) -> List[str]:
    """Apply every CPU adaptation once; returns what was patched (empty when a GPU is present).

    Idempotent: a second call returns the same list without patching again.
    """
    if _APPLIED:
        return list(_APPLIED)
    if gpu_present() and not force:
        logger.info("megatron_patches.cpu: a GPU is present; nothing patched")
        return []
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in SUPPORTED_MEGATRON_CORE:
        logger.warning("megatron_patches.cpu: written for megatron-core %s, found %s",
                       SUPPORTED_MEGATRON_CORE, version)
    _APPLIED.extend(apply_upstream_fixes())
    _run_patches(_PATCHES, _APPLIED, "megatron_patches.cpu")
    _APPLIED.append("cuda_as_cpu() context available for DDP/optimizer/clip_grads")
    return list(_APPLIED)


class _WallClockEvent:
    """Stand-in for torch.cuda.Event on CPU: Megatron only uses it to time tokens."""

    def __init__(self, *args, **kwargs):
        self.t = time.perf_counter()

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other: "_WallClockEvent") -> float:
        return (other.t - self.t) * 1e3


@contextlib.contextmanager
def cpu_generate_shims():
    """Megatron-Core 0.16.1's static generate path calls torch.cuda.current_device(), torch.cuda.Event (timing) and
    Tensor.cuda() once: on a machine without a GPU, map those to the CPU while the context is open (a no-op when a
    GPU is present)."""
    if torch.cuda.is_available():
        yield
        return
    saved = (torch.cuda.current_device, torch.cuda.Event, torch.Tensor.cuda)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Event = _WallClockEvent
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.Event, torch.Tensor.cuda = saved
