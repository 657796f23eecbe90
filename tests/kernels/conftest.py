"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

triton.jit reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is imported; it is set here before
this folder's test modules import minite.kernels. If an earlier test folder (collected first) already
imported the kernel modules without it, they are reloaded so that their kernels are interpreted. On a machine with a
GPU nothing changes: the same tests run compiled (test_kernels_gpu.py has the real-shape versions).
"""
import importlib
import os
import sys

import torch

KERNEL_MODULES = ("minite.kernels._interpreter", "minite.kernels.nvfp4_quant", "minite.kernels.nvfp4_segments",
                  "minite.kernels.nvfp4_gemm", "minite.kernels.nvfp4_swiglu", "minite.kernels.nvfp4_values",
                  "minite.kernels.nvfp4_wgrad")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:  # in dependency order: swiglu imports from quant; _interpreter reads the variable
        if name in sys.modules:
            importlib.reload(sys.modules[name])
