"""Which implementation computes an NVFP4 op: the pure-PyTorch reference or the Triton kernels.

One capability probe decides, and says why when it falls back:
- "reference": always available (CPU and GPU), the specification every kernel is tested against.
- "triton": a CUDA tensor with Triton importable and the kernels registered; or a CPU tensor when Triton's
  interpreter is on (TRITON_INTERPRET=1, which Triton itself reads), as the CPU tests use it.

The kernels live a layer above the format (`minite.kernels` reads NVFP4Tensor and the scale formulas), so the format
never imports them: importing `minite.kernels` registers its entry points here (`register_kernels`), and
`minite.ops` imports it whenever Triton is installed. Code that calls minite.nvfp4 directly and wants the kernels
imports `minite.kernels` (or `minite.ops`) first; until then "auto" computes on the reference (same quantisation bits,
exact GEMM sums) and "triton" says what is missing.
- "auto": Triton on a CUDA tensor when the probe passes, otherwise the reference.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Callable

import torch

log = logging.getLogger(__name__)
BACKENDS = ("auto", "reference", "triton")
_KERNELS: dict[str, Callable] = {}
_NEEDED = {"quantize": ("quantize_with_values", "quantize_segments"),
           "gemm": ("gemm", "grouped_gemm", "segmented_gemm")}


def register_kernels(**entry_points: Callable) -> None:
    """Called by minite.kernels on import: name -> Triton entry point (see _NEEDED for the names)."""
    _KERNELS.update(entry_points)


def kernel(name: str) -> Callable:
    """The registered Triton entry point `name` (only after `resolve` chose "triton", or `has_kernel` said yes)."""
    return _KERNELS[name]


def has_kernel(name: str) -> bool:
    """Whether minite.kernels registered `name` (entry points outside the quantise/GEMM probe, e.g. finite_max)."""
    return name in _KERNELS


@functools.cache
def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def triton_unavailable_reason(tensor: torch.Tensor, op: str) -> str | None:
    """None when the Triton path can run `op` on `tensor`, else the reason it cannot."""
    if not _module_present("triton"):
        return "triton is not installed"
    missing = [n for n in _NEEDED[op] if n not in _KERNELS]
    if missing:
        return f"the Triton kernels are not loaded (import minite.kernels first; missing {', '.join(missing)})"
    if tensor.is_cuda:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"tensor is on {tensor.device.type} and Triton's interpreter is off (TRITON_INTERPRET=1 enables it)"


@functools.cache
def _log_fallback_once(op: str, reason: str) -> None:
    log.info("nvfp4 %s: using the reference backend (%s)", op, reason)


def resolve(requested: str, tensor: torch.Tensor, op: str) -> tuple[str, str]:
    """(backend name, reason) for running `op` ("quantize" or "gemm") on `tensor`."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "reference":
        return "reference", "requested"
    reason = triton_unavailable_reason(tensor, op)
    if requested == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run {op}: {reason}")
        return "triton", "requested"
    if tensor.is_cuda and reason is None:
        return "triton", "CUDA tensor"
    reason = reason or "CPU tensor"
    if tensor.is_cuda:
        _log_fallback_once(op, reason)
    return "reference", reason
