"""Megatron's apply_rotary_pos_emb (as megatron.core.transformer.attention calls it), dispatched per call:

    strict mode (config.minite_strict)              minite.strict.ops.rope (`strict_rope`)
    CUDA bf16 bshd, no autograd, whole-head rotary   minite.kernels.megatron_rope: Megatron's unfused arithmetic in
                                                     one launch instead of ~12 (rollout decode steps)
    anything else                                    Megatron's own function

`install` is idempotent; the model builder (megatron_patches.qwen3_moe.build_gpt_model) and apply_strict call it.

It also makes a static-batching KV cache hold roped keys (`ROPED_KV_CACHE`). Megatron-Core 0.16.1 writes each
forward's keys into the cache before RoPE and then rotates the whole cached prefix, [0, q), on every decode step:
work and bytes that grow with the context (at 2,048 positions and batch 64, 134 MB read and written a layer and
step). Here a forward's new keys are rotated once, with their own rows of the same RoPE table, before the cache
write, and the forward then rotates the queries only. RoPE is elementwise per position (Megatron's arithmetic and
the kernels above compute each element from that element, its partner and its position's angle, whatever the other
positions), so every key the attention reads has the bits it had when the whole prefix was rotated per step
(tests/rollout/test_roped_kv_cache.py compares `ROPED_KV_CACHE` off and on, on the CPU and the GPU).
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
    _install_roped_kv_cache(attention_mod)


ROPED_KV_CACHE = True
"""Whether a static-batching KV cache holds roped keys (module docstring). Off: Megatron's own order, the whole
prefix rotated per step (the tests compare the two). Read on every forward: a cache filled under one setting must be
refilled before the other reads it (the decoder's `reset()`)."""


def _install_roped_kv_cache(attention_mod) -> None:
    cls = attention_mod.Attention
    if getattr(cls._adjust_key_value_for_inference, "_minite_roped_kv_cache", False):
        return
    upstream = cls._adjust_key_value_for_inference

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args,
                                        **kwargs):
        context = inference_context if inference_context is not None else kwargs.get("inference_params")
        if not _roped_cache_applies(self, context, key, rotary_pos_emb):
            return upstream(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        start = context.sequence_len_offset
        # (upstream asserts this after the rotation below, which would fail first and less clearly)
        assert start + key.size(0) <= context.max_sequence_length, (
            "Current sequence length is longer than expected maximum sequence length! "
            "Increase inference_max_seq_length.")
        # the new keys' rows of the table the forward would rotate the cached prefix with, and its call's arguments
        key = attention_mod.apply_rotary_pos_emb(
            key, rotary_pos_emb[1][start: start + key.size(0)], config=self.config, cu_seqlens=None,
            mscale=attention_mod._yarn_get_concentration_factor_from_config(self.config),
            cp_group=self.pg_collection.cp)
        query, key, value, rotary_pos_emb, mask_type, block_table = upstream(
            self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        return query, key, value, (rotary_pos_emb[0], None), mask_type, block_table  # no key rotation after it

    _adjust_key_value_for_inference._minite_roped_kv_cache = True
    cls._adjust_key_value_for_inference = _adjust_key_value_for_inference
    logger.info("megatron.core.transformer.attention.Attention: a static KV cache holds roped keys "
                "(megatron_patches.rope)")


def _roped_cache_applies(attention, context, key, rotary_pos_emb) -> bool:
    """A forward of static-batching inference over a KV cache, self-attention with query and key RoPE (what
    minite/rollout/decode.py runs). Not: training, flash decode (which rotates before its cache write itself),
    multi-latent attention, dynamic batching (which rotates before its cache append itself). The method does not see
    packed_seq_params: a static context is assumed never to run packed (THD) sequences, whose keys take their
    positions from cu_seqlens; neither Megatron's static engine nor minite does."""
    config = attention.config
    return (ROPED_KV_CACHE and context is not None and context.is_static_batching() and not attention.training
            and not config.flash_decode and not getattr(config, "multi_latent_attention", False)
            and getattr(attention, "attention_type", "self") == "self"
            and torch.is_tensor(key) and key.dim() == 4
            and isinstance(rotary_pos_emb, tuple) and len(rotary_pos_emb) == 2
            and rotary_pos_emb[0] is not None and rotary_pos_emb[1] is not None)


def _fused_applies(t, freqs, config, args, kwargs) -> bool:
    if args or set(kwargs) - {"mscale", "cu_seqlens", "cp_group"} or kwargs.get("cu_seqlens") is not None:
        return False
    if config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention:
        return False
    if not t.is_cuda or (torch.is_grad_enabled() and (t.requires_grad or freqs.requires_grad)):
        return False
    from minite.kernels import megatron_rope
    return megatron_rope.applies(t, freqs)
