"""Session-wide test setup.

On a machine without CUDA the Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before
anything imports triton: triton.language's own helpers (tl.cdiv, ...) are decorated when triton is first imported,
and helpers decorated without the interpreter fail inside interpreted kernels ("Cannot call @triton.jit'd outside of
the scope of a kernel"). Upstream packages the suite imports (Megatron-Core, SGLang) can import triton early, so it
is set here, at the root, before any test module is collected. The library itself never reads it at import time;
`minite.nvfp4.backend` only consults it when asked for backend="triton" on a CPU tensor.

TORCHDYNAMO_DISABLE=1 on a machine without CUDA, as `minite` (cli.py) sets it: Megatron's jit_fuser is torch.compile,
whose fused bf16 SwiGLU rounds differently from eager ops, so tests of upstream modules would otherwise depend on
whether an earlier test folder (tests/sglang sets it too) already switched it off.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
