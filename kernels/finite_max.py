"""The NaN/Inf flag of the NVFP4 layers in one launch: flag = max(flag, max |x|), a NaN counted as +Inf.

`minite.ops.FiniteFlag.record` runs this on CUDA tensors instead of torch's inf-norm and an in-place maximum: in a
rollout's decode step those were four graph nodes per quantised linear (a memset, the reduction, the maximum, and
the idle gap before the reduction: ~12 us on the H200, 16 linears a step of the 4-layer slice). The activation
quantisers now take the flag in their own pass (nvfp4_quant.py's FLAG, nvfp4_swiglu.py), which leaves this launch to
a weight's record and to a record with no kernel quantiser behind it. Each program takes
the max of |x| over its block (NaN -> +Inf, so the flag stays non-finite whatever the order) and one fp32 atomic max
into the flag; the values are >= 0, where the float order is the integer order of the bits, so the result is the
exact max (or +Inf) whatever order the programs run in. A non-contiguous input is copied first (the quantisers'
inputs are contiguous).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import ensure_interpreter_compat
from ._launch import cdiv, launcher

BLOCK = 4096


@triton.jit
def _max_into_flag(flag_ptr, a):
    """flag = max(flag, max of a), a 1-D block of |x| in fp32 with NaN counted as +Inf (also for kernels that record
    what they quantise themselves: minite.kernels.nvfp4_swiglu)."""
    a = tl.where(a == a, a, float("inf"))
    tl.atomic_max(flag_ptr, tl.max(a, axis=0))


@triton.jit
def _finite_max_kernel(x_ptr, n, flag_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _max_into_flag(flag_ptr, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))


def finite_max_into(t: torch.Tensor, flag: torch.Tensor) -> None:
    """flag (fp32, one element, on t's device) = max(flag, max |t|), NaN as +Inf; no host synchronisation."""
    if flag.dtype != torch.float32 or flag.numel() != 1 or flag.device != t.device:
        raise ValueError(f"finite_max_into: the flag must be one fp32 element on {t.device}, got {flag.dtype} "
                         f"{tuple(flag.shape)} on {flag.device}")
    ensure_interpreter_compat()
    x = t.detach().reshape(-1)
    if x.numel():
        launcher(_finite_max_kernel)[(cdiv(x.numel(), BLOCK),)](x, x.numel(), flag, BLOCK=BLOCK, num_warps=4)
