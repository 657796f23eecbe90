"""Which implementation computes an NVFP4 op: the pure-PyTorch reference or the Triton kernels.

One capability probe decides, and says why when it falls back:
- "reference": always available (CPU and GPU), the specification every kernel is tested against.
- "triton": a CUDA tensor with Triton importable and the kernel module present; or a CPU tensor when Triton's
  interpreter is on (TRITON_INTERPRET=1, which Triton itself reads), as the CPU tests use it.
- "auto": Triton on a CUDA tensor when the probe passes, otherwise the reference.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)
BACKENDS = ("auto", "reference", "triton")
_KERNEL_MODULES = {"quantize": "minite.kernels.nvfp4_quant", "gemm": "minite.kernels.nvfp4_gemm"}


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
    if not _module_present(_KERNEL_MODULES[op]):
        return f"{_KERNEL_MODULES[op]} is not available"
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
