"""Strict mode's expert SwiGLU (`minite.ops.experts.swiglu(strict=True)`: `ops.silu`, x / (1 + exp(-x)) with strict
mode's exp, times up, times prob) fused with FC2's NVFP4 activation quantisation: the strict twin of
`minite.kernels.nvfp4_swiglu.expert_swiglu_quantize_triton`, which takes the silu below in place of torch's.

The silu is `ops.silu`'s operations: -x (exact), strict exp's fp64 range reduction and Horner polynomial
(`fused._exp64`, the arithmetic of `fused.exp`), 1 + e and the division in fp32 (`tl.div_rn`), launched without FMA
contraction as every strict kernel is: IEEE operations in the same order, so the bits of the torch ops
(tests/strict/test_fused_swiglu.py under the interpreter on the CPU, compiled on a GPU). Routed for
"swiglu" in `fused.PROVEN`.
"""
from __future__ import annotations

import torch

from minite.nvfp4 import NVFP4Tensor

from . import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep CPU imports cheap and safe
    triton = None

if triton is not None:
    _C = [tl.constexpr(fused.EXP_ARGS[f"C{i}"]) for i in range(14)]
    _C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12, _C13 = _C
    _LOG2E, _LN2_HI, _LN2_LO, _RNE = (tl.constexpr(fused.EXP_ARGS[k]) for k in ("LOG2E", "LN2_HI", "LN2_LO", "RNE"))

    @triton.jit
    def _strict_silu(g):
        e = fused._exp64((-g).to(tl.float64), _C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12,
                         _C13, _LOG2E, _LN2_HI, _LN2_LO, _RNE)
        return tl.div_rn(g, 1.0 + e)


def swiglu_quantize(h: torch.Tensor, probs: torch.Tensor, flag: torch.Tensor | None = None,
                    values: bool = True) -> NVFP4Tensor:
    """The activation recipe's quantisation of swiglu(h, probs, strict=True) (see expert_swiglu_quantize_triton)."""
    from minite.kernels.nvfp4_swiglu import expert_swiglu_quantize_triton

    if triton is None:
        raise ValueError("strict fused swiglu needs Triton")
    return expert_swiglu_quantize_triton(h, probs, flag=flag, values=values, silu=_strict_silu, fp_fusion=False)
