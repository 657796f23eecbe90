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

And with the roped cache, a decode step's queries and keys in one launch (`QK_NORM_ROPE_KERNEL`, once proven):
SelfAttention.get_query_key_value_tensors returns the split, q/k-normalised heads, and the forward then rotates the
queries and writes the key and value into the cache, nine launches a layer (minite.kernels.qk_norm_rope). Where it
applies (a static context whose cache exists, no autograd, not strict, one whole-head RoPE table, torch's RMSNorm on
q and k) the patched method computes the projection as upstream does and hands the rest to
`qk_norm_rope.qk_norm_rope_cache`: the rotated queries, and the cache rows of the key and value, written. Attention's
forward is wrapped to tell the method the step's context and RoPE table (it is not passed them), and the cache
method then writes each row onto itself (torch's copy_ returns at once for a view onto itself) and rotates nothing.
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
    _install_qk_norm_rope(attention_mod)


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
        if self.__dict__.pop("_minite_qkv_written", False):  # get_query_key_value_tensors wrote and rotated them
            return upstream(self, inference_context, query, key, value, None, *args, **kwargs)
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
    return (_static_self_attention(attention, context) and torch.is_tensor(key) and key.dim() == 4
            and isinstance(rotary_pos_emb, tuple) and len(rotary_pos_emb) == 2
            and rotary_pos_emb[0] is not None and rotary_pos_emb[1] is not None)


def _static_self_attention(attention, context) -> bool:
    """The roped cache on, and a self-attention forward of static-batching inference (`_roped_cache_applies`' and
    `_qk_norm_rope_applies`' common part): not training, flash decode, multi-latent attention or dynamic batching."""
    config = attention.config
    return (ROPED_KV_CACHE and context is not None and context.is_static_batching() and not attention.training
            and not config.flash_decode and not getattr(config, "multi_latent_attention", False)
            and getattr(attention, "attention_type", "self") == "self")


def _fused_applies(t, freqs, config, args, kwargs) -> bool:
    if args or set(kwargs) - {"mscale", "cu_seqlens", "cp_group"} or kwargs.get("cu_seqlens") is not None:
        return False
    if config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention:
        return False
    if not t.is_cuda or (torch.is_grad_enabled() and (t.requires_grad or freqs.requires_grad)):
        return False
    from minite.kernels import megatron_rope
    return megatron_rope.applies(t, freqs)


QK_NORM_ROPE_KERNEL = "qk_norm_rope"
"""The name under which a decode step's fused query/key preparation waits for its GPU test
(`minite.strict.fused.WAITS_FOR`) and is routed once proven (module docstring)."""


def _install_qk_norm_rope(attention_mod) -> None:
    cls = attention_mod.SelfAttention
    if getattr(cls.get_query_key_value_tensors, "_minite_qk_norm_rope", False):
        return
    upstream_qkv, upstream_forward = cls.get_query_key_value_tensors, attention_mod.Attention.forward

    def forward(self, *args, **kwargs):
        # TransformerLayer passes these by keyword (Megatron-Core 0.16.1); a positional call is told nothing, and
        # packed sequences (whose keys take their positions from cu_seqlens) none either
        previous = self.__dict__.get("_minite_qkv_step")
        self._minite_qkv_step = (None if kwargs.get("packed_seq_params") is not None else
                                 (kwargs.get("inference_context", kwargs.get("inference_params")),
                                  kwargs.get("rotary_pos_emb")))
        try:
            return upstream_forward(self, *args, **kwargs)
        finally:  # nothing left for a later forward, also after an exception between the two methods
            self._minite_qkv_step = previous
            self.__dict__.pop("_minite_qkv_written", None)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        step = self.__dict__.get("_minite_qkv_step")
        if step is None or not _qk_norm_rope_applies(self, hidden_states, step, output_gate, split_qkv):
            return upstream_qkv(self, hidden_states, key_value_states, output_gate=output_gate,
                                split_qkv=split_qkv)
        from megatron.core.typed_torch import apply_module

        from minite.kernels import qk_norm_rope
        context, rotary = step
        mixed_qkv, _ = apply_module(self.linear_qkv)(hidden_states)  # upstream's call
        groups, head = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        rep = self.num_attention_heads_per_partition // groups
        mixed = mixed_qkv.view(*mixed_qkv.shape[:2], groups, (rep + 2) * head)
        start, first = context.sequence_len_offset, context.batch_size_offset
        n, rows = mixed.shape[0], mixed.shape[1]
        keys, values = context.key_value_memory_dict[self.layer_number]
        q_pos, k_pos = rotary if isinstance(rotary, tuple) else (rotary, rotary)
        fits = start + n <= min(keys.shape[0], q_pos.shape[0], k_pos.shape[0]) and first + rows <= keys.shape[1]
        if not (fits and qk_norm_rope.applies(mixed, rep, head)):  # upstream's split of the projection it computed
            query, key, value = torch.split(mixed, [rep * head, head, head], dim=3)
            return self.q_layernorm(query.reshape(n, rows, -1, head)), self.k_layernorm(key), value
        key, value = keys[start: start + n, first: first + rows], values[start: start + n, first: first + rows]
        query = qk_norm_rope.qk_norm_rope_cache(
            mixed, rep, self.q_layernorm.weight, self.k_layernorm.weight, self.q_layernorm.eps, self.k_layernorm.eps,
            q_pos[start: start + n], k_pos[start: start + n],
            attention_mod._yarn_get_concentration_factor_from_config(self.config), key, value)
        self._minite_qkv_written = True
        return query, key, value

    attention_mod.Attention.forward = forward
    get_query_key_value_tensors._minite_qk_norm_rope = True
    cls.get_query_key_value_tensors = get_query_key_value_tensors
    logger.info("megatron.core.transformer.attention.SelfAttention: a decode step's queries and keys in one launch "
                "where proven (megatron_patches.rope)")


def _qk_norm_rope_applies(attention, hidden, step, output_gate, split_qkv) -> bool:
    """Whether get_query_key_value_tensors takes the one launch (module docstring): proven (or tried) and the roped
    cache on; a static context whose cache for this layer exists and holds the forward's rows; no autograd; CUDA (or
    the CPU tests' interpreter); self-attention split into q, k, v without an output gate, tensor-parallel groups
    not split; not strict; q and k normalised by torch's RMSNorm with bf16 weights where torch takes its vectorised
    kernel (8-byte-aligned), and no forward hooks on them; one fp32 RoPE table per position over the whole head, not
    interleaved; bf16 heads of a power-of-two width the kernel takes. The projection's output is checked once
    computed (its dtype, and its rows against the cache and the tables): where it does not fit, the method splits it
    and calls the norms as upstream does."""
    from minite.kernels import qk_norm_rope
    from minite.kernels._interpreter import interpreting
    from minite.strict import fused
    context, rotary = step
    config = attention.config
    if not (QK_NORM_ROPE_KERNEL in fused.PROVEN and _static_self_attention(attention, context) and split_qkv
            and not output_gate and not torch.is_grad_enabled() and (hidden.is_cuda or interpreting())
            and hidden.dtype == torch.bfloat16 and attention.layer_number in context.key_value_memory_dict
            and not getattr(config, "minite_strict", False) and not config.no_rope_freq
            and not config.apply_rope_fusion and not config.rotary_interleaved
            and config.num_query_groups >= attention.world_size):
        return False
    head = attention.hidden_size_per_attention_head
    from torch.nn.modules import module as torch_module
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False  # someone watches every module (the norms are not called here)
    for norm in (attention.q_layernorm, attention.k_layernorm):
        if not (isinstance(norm, torch.nn.RMSNorm) and type(norm).forward is torch.nn.RMSNorm.forward
                and "forward" not in vars(norm) and not norm._forward_hooks and not norm._forward_pre_hooks
                and norm.weight is not None and norm.eps is not None
                and norm.weight.dtype == torch.bfloat16 and norm.weight.shape == (head,)
                and norm.weight.is_contiguous() and norm.weight.data_ptr() % 8 == 0):
            return False  # (minite diagnose hooks every module: its op capture sees upstream's norms)
    tables = rotary if isinstance(rotary, tuple) else (rotary, rotary)
    keys, values = context.key_value_memory_dict[attention.layer_number]
    rep = attention.num_attention_heads_per_partition // attention.num_query_groups_per_partition
    return (len(tables) == 2 and all(torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 4
                                     and t.shape[1:] == (1, 1, head) for t in tables)
            and keys.dtype == values.dtype == torch.bfloat16 and not config.sequence_parallel
            and qk_norm_rope.heads_apply(rep, head))
