"""Pieces every NVFP4 op shares: derived stochastic-rounding seeds, tensor-parallel amax groups, the quantisation
flags of the kernel path, and the zero-padding of token groups to 16-row blocks (wgrad quantises along tokens).

Stochastic-rounding seeds are *derived*, never drawn: the caller passes one integer (the layers use
hash(run seed, train step, layer index)) and each role gets `derive_seed(seed, ROLES[role])`. A run is then
reproducible and a resumed run draws the same rounding as an uninterrupted one.

A gradient's amax from the pass that wrote it: a tensor-scope quantisation needs max |x| over the whole tensor first,
a pass of its own over x unless the kernel that wrote x took it on the way (`hint_amax`; the experts' SwiGLU backward
for FC1's dgrad operand, the combine's backward for FC2's). The next quantisation of that same tensor takes the hint
(`hinted_amax`, as `quantize(..., global_amax=)`), bitwise the amax it would have computed, and skips the pass.

Tensor parallelism: a global scale is the amax over its scope; when that scope spans a TP-sharded dim, each rank sees
only a slice. `quantize_scoped` all-reduces (MAX) the amax over the TP group and hands it to the quantiser
(`quantize(..., global_amax=)`), so a shard quantises to exactly the values of the same slice of the unsharded
tensor (given 16-aligned shard boundaries).

The kernel path: when the GEMMs run on the Triton kernels, operands also carry fp16 block values (written in the
quantisation pass, read by the MMA without a nibble decode), and on a GPU the quantiser's own NaN/Inf check (a host
synchronisation each) is skipped (`quantiser_checks_finite`). Quantisation would hide a non-finite input (Inf
saturates to 6 x the block scale, NaN rounds to code 0), so the Megatron layers record instead whether their
quantised inputs were finite in a device-side flag (`FiniteFlag`), which its owner reads once per generate call.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from minite.nvfp4 import NonFiniteError, NVFP4Tensor, OperandRecipe, apply_rht
from minite.nvfp4.backend import has_kernel, kernel, resolve
from minite.nvfp4.quantize import fold_abs_max

_M32 = 0xFFFFFFFF
ROLES = {"gradient": 1, "wgrad_gradient": 2, "wgrad_input": 3}


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from integers (splitmix-style mixing): reproducible, well spread, in [0, 2^32)."""
    h = 0x243F6A88
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _M32


def derive_seeds(*parts) -> np.ndarray:
    """`derive_seed` over arrays: parts are integers or integer arrays (broadcast), the result the int64 array of
    the seeds `derive_seed` gives element by element. The MoE wgrad derives two seeds per expert per call (3,128 per
    learner step of 4 full-width layers: a Python loop of ~6 ms on the H200's host)."""
    arrays = [np.asarray(int(p) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64) if isinstance(p, (int, np.integer))
              else np.asarray(p).astype(np.int64).astype(np.uint64) for p in parts]  # int(p) & (2^64 - 1)
    h = np.full(np.broadcast_shapes(*(a.shape for a in arrays)), 0x243F6A88, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2^64, as derive_seed's mask
        for a in arrays:
            h = (h ^ a) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(31)
    return np.asarray(h & np.uint64(_M32)).astype(np.int64)


def host_counts(tokens_per_expert, experts: int, rows: int) -> list[int]:
    """Tokens per expert (host integers: a tensor is read by the caller, where the census of host synchronisations,
    tools/bench/sync_census.py, finds the read) as a checked list: `experts` non-negative entries summing to the
    `rows` input rows, else one ValueError."""
    counts = [int(c) for c in tokens_per_expert]
    if len(counts) != experts or sum(counts) != rows or min(counts, default=0) < 0:
        raise ValueError(f"tokens_per_expert {counts} must have {experts} non-negative entries "
                         f"summing to the {rows} input rows")
    return counts


def group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def group_amax(values: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    amax = values.abs().amax() if dim is None else values.abs().amax(dim=dim)
    amax = amax.float().contiguous()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


AMAX_HINT = "_minite_amax"
"""The tensor attribute `hint_amax` sets: (max |t| fp32 0-d, the write's key)."""


def _write_key(t: torch.Tensor) -> tuple:
    """What identifies the write a hint was taken from: the storage, the version counter (bumped by every in-place op),
    the shape and strides."""
    return t.data_ptr(), t._version, tuple(t.shape), t.stride()


def hint_amax(t: torch.Tensor, amax) -> torch.Tensor:
    """Attach amax = max |t| (fp32 0-d, NaN where t holds a NaN: what the quantiser's own amax pass gives) to t, as
    computed by the pass that wrote t, or a function that computes it from less than t (called once, when asked;
    it returns None where it can no longer tell: `lazy_abs_max`); returns t. Autograd hands a backward's output to
    the next backward as the same object, so a gradient carries its hint to the op that quantises it."""
    setattr(t, AMAX_HINT, (amax, _write_key(t)))
    return t


def hinted_amax(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The amax `hint_amax` attached to t, if nothing wrote t since (an in-place op, new storage, another view drop
    it); None otherwise (the quantiser then computes it)."""
    found = getattr(t, AMAX_HINT, None)
    if found is None or found[1] != _write_key(t):
        return None
    amax = found[0]
    if callable(amax):  # None from it: what it would read was written since (no hint)
        amax = amax()
        setattr(t, AMAX_HINT, (amax, found[1]))
    return amax


def lazy_abs_max(source: torch.Tensor):
    """A `hint_amax` function computing max |source| when asked (`abs_max`), or None if source was written since."""
    key = _write_key(source)
    return lambda: abs_max(source) if _write_key(source) == key else None


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| as fp32 0-d on t's device (+0 for an empty t; NaN if t holds a NaN): on a GPU with the kernels the
    quantisers' amax pass (kernels/nvfp4_quant.py `amax_triton`; torch's aminmax read 64 MB at ~1.2 TB/s on an H100),
    elsewhere one `aminmax` read."""
    if t.is_cuda and t.dim() == 2 and has_kernel("amax"):
        return kernel("amax")(t)
    lo, hi = _min_max(t)
    return torch.maximum(-lo, hi).abs().float()  # abs: +0 where max(+0, -0) gives -0


def quantiser_checks_finite(t: torch.Tensor) -> bool:
    """Whether quantising `t` checks for NaN/Inf on the spot: off the GPU only (on it, a host synchronisation per
    call; callers there record into a `FiniteFlag`)."""
    return not t.is_cuda


def quant_flags(backend: str, t: torch.Tensor, values: bool = True) -> dict:
    """Keyword arguments for quantising `t` here: fp16 block values when the GEMMs run on the Triton kernels (they
    read them) unless values=False (the kernels then read the packed codes), and the NaN/Inf check only where
    `quantiser_checks_finite`."""
    return {"values": values and resolve(backend, t, op="gemm")[0] == "triton",
            "check_finite": quantiser_checks_finite(t)}


def collective_device(group=None) -> torch.device:
    """Where a collective of `group` (default: the world) takes its tensors: the current GPU under NCCL, else the
    CPU."""
    nccl = torch.distributed.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def any_rank(flag, group) -> bool:
    """Whether `flag` (a bool or a one-element tensor) is true on any rank of `group`: a collective every rank of the
    group calls, one host read."""
    t = torch.as_tensor(flag).to(device=collective_device(group), dtype=torch.float32).reshape(())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t)


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first name (in order) whose tensor holds a NaN or Inf, or None. One reduction per tensor,
    `torch.aminmax` (NaN propagates into both results, an Inf shows as the min or the max): a single read of the
    tensor, where `isfinite(t).all()` is five kernels over it and three bool temporaries of its size (on the H200 the
    check was 11.5 of a 31.5 ms weight sync, docs/benchmarks.md). The results stay on their device and are read back
    once per device: one host synchronisation per call, not one per tensor (a weight update, a checkpoint's load)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append(name)
    finite: dict[str, bool] = {}
    for names in by_device.values():
        ends = torch.stack([end for n in names for end in _min_max(tensors[n])]).view(len(names), 2)
        finite.update(zip(names, torch.isfinite(ends).all(dim=1).tolist()))
    return next((n for n in tensors if not finite[n]), None)


def _min_max(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of t as 0-d tensors on its device, one kernel; zeros for an empty t (aminmax refuses it)."""
    if t.numel() == 0:
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        return zero, zero
    return torch.aminmax(t)


class FiniteFlag:
    """Whether every tensor recorded since the last `check` was finite, kept on the device as the running max of
    |x| in fp32. `record` has no host synchronisation, so it can also be captured in a CUDA graph once the flag
    exists: on a CUDA tensor with the kernels loaded it is one launch (minite.kernels.finite_max: a NaN counts as
    +Inf), elsewhere torch's inf-norm and an in-place maximum (both propagate NaN; Inf stays Inf); a quantiser on the
    kernels takes it in its own pass, with no launch of its own (`flag_for`). `check` reads it once, resets it and
    raises a one-line NonFiniteError (a ValueError) naming `where` if anything recorded was NaN or Inf."""

    def __init__(self):
        self._amax: Optional[torch.Tensor] = None

    def record(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        self.tensor(t.device)  # made, or moved off the CPU, once (`tensor`)
        if t.device == self._amax.device and t.is_cuda and has_kernel("finite_max"):
            kernel("finite_max")(t, self._amax)  # one launch (minite.kernels.finite_max; NaN counts as +Inf)
            return
        fold_abs_max(self._amax, t)

    def flag_for(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The flag, for t's quantiser to take max |t| into in its own pass (`quantize(finite_flag=)`), where the
        quantiser does not check t itself and the flag lives on t's device; else None, with t recorded here if
        it needs to be (so a caller records every tensor it quantises either way)."""
        if quantiser_checks_finite(t):
            return None
        flag = self.tensor(t.device)
        if flag.device != t.device:
            self.record(t)
            return None
        return flag

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The flag itself (fp32, one element; made on `device` if there is none yet), for a kernel that takes max |x|
        into it as `record` does (NaN as +Inf: `minite.kernels.nvfp4_swiglu.expert_swiglu_quantize_triton`)."""
        # The flag is a normal tensor even when first made under torch.inference_mode (a generate): an inference
        # tensor could not be updated in place afterwards outside it (a weight update re-quantising, a train step).
        # A flag on a GPU is never replaced: CUDA graphs captured with records hold its address (replacing it
        # left them writing into freed memory: a CPU tensor recorded into a GPU engine's flag moved the flag, and
        # the next graph replay corrupted that generate's tokens; H200, 2026-12-01). A CPU flag moves to the GPU
        # once (no graph holds it); a record from another device is folded into the flag where it lives.
        with torch.inference_mode(False):
            if self._amax is None:
                self._amax = torch.zeros((), dtype=torch.float32, device=device)
            elif self._amax.device != device and not self._amax.is_cuda:
                self._amax = self._amax.to(device)
        return self._amax

    def check(self, where: str, group=None) -> None:
        """Raise if anything recorded was NaN or Inf; with `group` (a process group), if any rank's was: a collective
        every rank of the group must call (each with a flag, recorded or not)."""
        if group is None:
            if self._amax is None:
                return
            bad = not math.isfinite(float(self._amax))  # the one host read
        else:
            bad = any_rank(self._amax is not None and ~torch.isfinite(self._amax), group)  # the one host read
        if self._amax is not None:
            self._amax.zero_()
        if bad:
            raise NonFiniteError(f"NaN or Inf reached an NVFP4 quantiser during {where} (a weight or activation of "
                                 "the model is not finite)")


def quantize_scoped(x: torch.Tensor, op: OperandRecipe, *, seed: Optional[int], backend: str,
                     amax_group=None, values: bool = True, finite: Optional[FiniteFlag] = None) -> NVFP4Tensor:
    """`op.quantize(x)`, with the global-scale amax taken over `amax_group` (TP) when it has > 1 rank; block values
    kept when the kernels will read them; the NaN/Inf check only off the GPU (see the module docstring), where
    `finite` (if given) records x, in the quantiser's own pass on the kernels (`FiniteFlag.flag_for`)."""
    amax = None
    if group_size(amax_group) > 1:
        if op.scale_scope == "row" and op.rht:
            raise ValueError("per-row scales with RHT are not supported under tensor parallelism")
        seen = apply_rht(x) if op.rht else x
        amax = group_amax(seen, 1 if op.scale_scope == "row" else None, amax_group)
    flag = None if finite is None else finite.flag_for(x)
    return op.quantize(x, seed=seed, backend=backend, global_amax=amax, finite_flag=flag,
                       **quant_flags(backend, x, values))



def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [R, C] with zero rows appended up to `rows` >= R (the dense wgrad's tokens to a multiple of 16): one
    constant pad, no host tables (t itself when R == rows). The MoE wgrad pads each expert inside the quantiser
    (`quantize_column_segments(counts=...)`)."""
    if rows == t.shape[0]:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def refill_in_place(old, new) -> bool:
    """Copy `new`'s tensors into `old`'s (an NVFP4Tensor, NVFP4Stack, or a dataclass / sequence of them) so that
    whoever holds old's tensors, e.g. a CUDA graph that captured their addresses, sees new's values; old's derived
    caches ("_" fields, e.g. a cached transpose) are dropped. The copies run under torch.inference_mode, so old may
    hold inference tensors (a cache first made inside a generate). False, with nothing copied, when the two differ in
    layout (tensor shapes, dtypes, devices or plain fields). A tensor old shares with new (a view of the same
    parameter) is left as it is."""
    la, lb = _leaves(old), _leaves(new)
    same = len(la) == len(lb) and all(
        (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device) if torch.is_tensor(x) and torch.is_tensor(y)
        else (not torch.is_tensor(x) and not torch.is_tensor(y) and x == y) for x, y in zip(la, lb))
    if not same:
        return False
    with torch.inference_mode():  # old's tensors may be inference tensors (made inside a generate): writable here only
        for x, y in zip(la, lb):
            if torch.is_tensor(x) and x.data_ptr() != y.data_ptr():
                x.copy_(y)
    for obj in [old, *(old if isinstance(old, (list, tuple)) else [])]:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                if f.name.startswith("_"):
                    setattr(obj, f.name, None)
    return True


def _leaves(x) -> list:
    """The tensors and plain values of a quantised weight (dataclass fields but its "_" caches, sequences), in a
    fixed order."""
    if torch.is_tensor(x):
        return [x]
    if dataclasses.is_dataclass(x):
        return [leaf for f in dataclasses.fields(x) if not f.name.startswith("_") for leaf in _leaves(getattr(x, f.name))]
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in _leaves(item)]
    return [x]
