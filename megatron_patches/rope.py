"""Megatron's apply_rotary_pos_emb (as megatron.core.transformer.attention calls it), dispatched per call:

    strict mode (config.minite_strict)              minite.strict.ops.rope (`strict_rope`)
    CUDA bf16 bshd, no autograd, whole-head rotary   minite.kernels.megatron_rope: Megatron's unfused arithmetic in
                                                     one launch instead of ~12 (rollout decode steps)
    anything else                                    Megatron's own function

`install` is idempotent; the model builder (megatron_patches.qwen3_moe.build_gpt_model) and apply_strict call it.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def strict_rope(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron's apply_rotary_pos_emb signature over minite.strict.ops.rope (bshd, non-interleaved, as Qwen3)."""
    from minite.strict import ops as S

    if cu_seqlens is not None or config.rotary_interleaved or config.multi_latent_attention:
        raise ValueError("strict RoPE supports the bshd, non-interleaved layout only")
    return S.rope(t, freqs, mscale)


def install() -> None:
    import megatron.core.transformer.attention as attention_mod

    if getattr(attention_mod.apply_rotary_pos_emb, "_minite_rope_dispatch", False):
        return
    from minite.kernels import megatron_rope  # needs Triton: imported when installed, not per call
    upstream = attention_mod.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, *args, **kwargs):
        if getattr(config, "minite_strict", False):
            return strict_rope(t, freqs, config, *args, **kwargs)
        if _fused_applies(t, freqs, config, args, kwargs):
            return megatron_rope.rope(t, freqs, kwargs.get("mscale", 1.0))
        return upstream(t, freqs, config, *args, **kwargs)

    apply_rotary_pos_emb._minite_rope_dispatch = True
    attention_mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    logger.info("megatron.core.transformer.attention.apply_rotary_pos_emb dispatches per call (megatron_patches.rope)")


def _fused_applies(t, freqs, config, args, kwargs) -> bool:
    if args or set(kwargs) - {"mscale", "cu_seqlens", "cp_group"} or kwargs.get("cu_seqlens") is not None:
        return False
    if config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention:
        return False
    if not t.is_cuda or (torch.is_grad_enabled() and (t.requires_grad or freqs.requires_grad)):
        return False
    from minite.kernels import megatron_rope
    return megatron_rope.applies(t, freqs)
