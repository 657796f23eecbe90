"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET is read by triton.jit when a kernel module is imported, so it is set here, before any test module
of this folder imports minite.kernels. On a machine with a GPU the same tests run compiled (tests/gpu has the
real-shape versions).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
