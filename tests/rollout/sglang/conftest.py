"""Shared set-up of the SGLang tests (real SGLang 0.5.23 on CPU).

Everything here is test tooling. While the tests of this folder run (a package-scoped autouse fixture), and only on a
machine without a GPU, tests/rollout/sglang/stubs (stand-ins for the CUDA-only modules SGLang imports, see stubs/README.md)
is first on sys.path and PYTHONPATH (for SGLang's subprocesses) and SGLang's CPU engine is on; both are undone after.
`sglang_skip_reason()` is the capability probe (no import, so collecting this folder changes nothing): every test
here that needs SGLang skips with its reason when SGLang is missing or another version.
"""
from __future__ import annotations

import importlib.metadata
import os
import socket
import sys
from pathlib import Path

import pytest

STUBS = str(Path(__file__).parent / "stubs")
WANT = "0.5.23"


@pytest.fixture(scope="package", autouse=True)
def cpu_stand_ins():
    """Stand-ins and CPU engine switches for this folder's tests only (module docstring)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE")}
    sys.path.insert(0, STUBS)
    paths = [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([STUBS] + paths)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        yield
    finally:
        if STUBS in sys.path:
            sys.path.remove(STUBS)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sglang_skip_reason() -> str | None:
    try:
        have = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return f"needs sglang=={WANT} (tools/setup.sh installs it with tools/sglang_requirements.txt)"
    if have != WANT:
        return f"needs sglang=={WANT}, found {have}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_hf_checkpoint(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3-MoE written by transformers (no downloads); per-expert tensor names."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=256, norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.1)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir
