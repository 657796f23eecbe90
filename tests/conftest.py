"""Session-wide test setup.

On a machine without CUDA the Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before
anything imports triton: triton.language's own helpers (tl.cdiv, ...) are decorated when triton is first imported,
and helpers decorated without the interpreter fail inside interpreted kernels ("Cannot call @triton.jit'd outside of
the scope of a kernel"). Upstream packages the suite imports (Megatron-Core, SGLang) can import triton early, so it
is set here, at the root, before any test module is collected. The library itself never reads it at import time;
`minite.nvfp4.backend` only consults it when asked for backend="triton" on a CPU tensor.

TORCHDYNAMO_DISABLE=1 on a machine without CUDA, as `minite` (cli.py) sets it: Megatron's jit_fuser is torch.compile,
whose fused bf16 SwiGLU rounds differently from eager ops, so tests of upstream modules would otherwise depend on
whether an earlier test folder (tests/rollout/sglang sets it too) already switched it off.

GPU tests live beside the CPU tests of the same code, marked `gpu`; the capability probe below skips them, saying why,
where no CUDA device of compute capability >= 9.0 is present.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def cuda_sm90_reason() -> str | None:
    """None when a CUDA device of compute capability >= 9.0 is present, else why the GPU tests cannot run."""
    if not torch.cuda.is_available():
        return "needs CUDA sm_90 (no CUDA device)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs CUDA sm_90 (found sm_{major}{minor})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = cuda_sm90_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
