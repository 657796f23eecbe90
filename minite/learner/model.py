"""Building the learner's model from a `minite.config.Config`: parallel state, then a Qwen3-MoE GPTModel.

`build_model(cfg)` is shared by the learner and the embedded rollout engine, so both hold the same module tree,
parameter names and NVFP4 layers. The model is a function of (cfg.model, cfg.precision, cfg.rl.seed) only: Megatron's
CPU initialisation builds each full weight from torch's global generator and keeps the local shard, and
GroupedExperts does the same per expert, so the initial model is the same for every TP/EP layout. One exception:
a shared expert's SwiGLU fc1 under TP > 1 (Megatron splits its [gate; up] master by rows, so each rank gets a
slice of one half); `Learner.full_weights()` still gathers any TP model into the exact TP=1 layout.

Parallel state: `init_parallel(cfg)` starts torch.distributed if nobody has (gloo, or NCCL with a GPU; world size 1
on a free local port, or the torchrun environment when RANK/WORLD_SIZE are set; reading the environment here is the launcher's
job done once, at start) and Megatron's model-parallel groups with TP/EP from cfg.parallel (pipeline parallelism:
1 only). On a machine without a GPU it applies `megatron_patches.cpu` first.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from minite.config import Config
from minite.megatron_patches import cpu as cpu_patches
from minite.megatron_patches.nvfp4_layers import NVFP4Context
from minite.megatron_patches.qwen3_moe import build_gpt_model
from minite.megatron_patches.strict import apply_strict
from minite.models.qwen3_moe import Qwen3MoeShape

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(cfg: Config) -> None:
    """torch.distributed (gloo unless already started) and Megatron's TP/EP groups, once per process."""
    from megatron.core import parallel_state as ps

    cpu_patches.apply_upstream_fixes()
    if not cpu_patches.gpu_present():
        cpu_patches.apply()
    par = cfg.parallel
    if not dist.is_initialized():
        backend = "nccl" if cpu_patches.gpu_present() else "gloo"
        if cpu_patches.gpu_present():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (par.tp * par.pp) or world % par.ep:
        raise ValueError(f"world size {world} is not divisible by parallel.tp={par.tp} and parallel.ep={par.ep}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (par.tp, par.ep):
            raise ValueError(f"Megatron parallel state already initialised with (tp, ep)={have}, "
                             f"config asks for ({par.tp}, {par.ep})")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=par.ep, expert_tensor_parallel_size=1)


def model_shape(cfg: Config) -> Qwen3MoeShape:
    """The architecture: from cfg.model.hf_config (a Qwen3-MoE config.json) if set, else cfg.model's fields."""
    return Qwen3MoeShape.from_any(cfg.model.hf_config or cfg.model)


def compute_dtype(cfg: Config) -> torch.dtype:
    return _DTYPES[cfg.precision.compute_dtype]  # params_dtype is float32 (PrecisionConfig refuses bfloat16)


def build_model(cfg: Config, *, strict: bool, init_parallel_state: bool = True):
    """A Qwen3-MoE GPTModel in cfg.precision.mode ("bf16" or "nvfp4"); identical for identical cfg.
    strict: switch every forward op to its batch-invariant version (megatron_patches.strict); callers pass
    cfg.alignment.strict, and say so."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if init_parallel_state:
        init_parallel(cfg)
    seed = cfg.rl.seed
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    cpu_state = torch.get_rng_state()
    torch.manual_seed(seed)  # Megatron's CPU init draws from the global generator
    try:
        ctx = NVFP4Context(recipe=cfg.precision.recipe, seed=seed) if cfg.precision.mode == "nvfp4" else None
        model = build_gpt_model(model_shape(cfg), precision=cfg.precision.mode, ctx=ctx,
                                compute_dtype=compute_dtype(cfg), tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    finally:
        torch.set_rng_state(cpu_state)
    # What Megatron's Float16Module does to its module: every float parameter (norms included) in the
    # compute dtype; fp32 master copies live in the optimizer.
    model = model.to(compute_dtype(cfg))
    if strict:
        apply_strict(model)
    return model.cuda() if cpu_patches.gpu_present() else model  # (GPU path: not exercised by the CPU tests)


def nvfp4_context(model) -> Optional[NVFP4Context]:
    """The model's shared NVFP4 state (recipe, seed, step), or None for a BF16 model."""
    return getattr(model, "nvfp4_context", None)
