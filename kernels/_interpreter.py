"""Triton CPU-interpreter helpers for the kernels' CPU tests (TRITON_INTERPRET=1).

triton 3.6's interpreter passes scalar kernel arguments as 1-element numpy arrays and converts them to Python ints
with int(array) when they bound a `range` loop; numpy >= 2.4 refuses int() of a 1-d array ("only 0-dimensional
arrays can be converted to Python scalars"), so every kernel with a runtime loop bound fails there. The patch below
converts through reshape(-1)[0] instead. It touches only the interpreter (never the compiled GPU path), is
idempotent, and is applied by the launchers only when the interpreter is on.

A second patch gives a `tl.reduce` whose combine function carries a `numpy_reduce` attribute (a numpy reduction
computing the same values, e.g. kernels/nvfp4_quant.py `_nan_max_combine`: np.max) that reduction in one numpy call:
the interpreter runs any other combine function element by element in Python (its `generic_reduce`), hundreds of
times slower on a quantiser's tiles.
"""
from __future__ import annotations

import os

import numpy as np


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: TRITON_INTERPRET=1 as it was when they were defined, which
    is when triton.jit reads it (read once, at this module's import with the kernels'; the launchers ask on every
    call, and an environment lookup costs ~2 us of host time)."""
    return _INTERPRETING


def ensure_interpreter_compat() -> None:
    """Make the interpreter's tensor.__index__ accept 1-element arrays (idempotent; no-op on the GPU path)."""
    if not interpreting():
        return
    from triton.runtime import interpreter as ti
    if getattr(ti, "_minite_index_patched", False) or not hasattr(ti, "_patch_lang_tensor"):
        return
    original = ti._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._minite_index_patched = True
    reduce_ops = getattr(ti, "ReduceOps", None)
    if reduce_ops is not None and hasattr(reduce_ops, "min_max"):
        generic = reduce_ops.apply_impl

        def apply_impl(self, input):
            op = getattr(self.combine_fn, "numpy_reduce", None)
            if op is None or len(input) != 1:
                return generic(self, input)
            return self.min_max(input[0], val_reduce_op=op, idx_reduce_op=None)

        reduce_ops.apply_impl = apply_impl
