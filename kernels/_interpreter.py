"""Triton CPU-interpreter helpers for the kernels' CPU tests (TRITON_INTERPRET=1).

triton 3.6's interpreter passes scalar kernel arguments as 1-element numpy arrays and converts them to Python ints
with int(array) when they bound a `range` loop; numpy >= 2.4 refuses int() of a 1-d array ("only 0-dimensional
arrays can be converted to Python scalars"), so every kernel with a runtime loop bound fails there. The patch below
converts through reshape(-1)[0] instead. It touches only the interpreter (never the compiled GPU path), is
idempotent, and is applied by the launchers only when the interpreter is on.
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
