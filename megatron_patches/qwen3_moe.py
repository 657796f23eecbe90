"""Qwen3-MoE as a Megatron-Core GPTModel, in BF16 or NVFP4 W4A4, from a Hugging Face config.json (no TE).

Architecture (Hugging Face Qwen3MoeForCausalLM) -> Megatron-Core 0.16.1 local-spec modules:
    RMSNorm (pre-attention, pre-MLP, final)   RMSNorm below (torch.nn.RMSNorm; sequence-parallel aware)
    q/k RMSNorm per head                      q_layernorm / k_layernorm (qk_layernorm=True)
    GQA, RoPE (theta = rope_theta)            SelfAttention(linear_qkv, FusedDotProductAttention, linear_proj)
    top-k softmax router                      TopKRouter: topk on logits then softmax over the k
                                              (= HF softmax, topk, renormalise: norm_topk_prob=True);
                                              norm_topk_prob=False -> moe_router_pre_softmax=True
    SwiGLU routed experts                     GroupedExperts (megatron_patches.nvfp4_layers)
    optional shared expert                    SharedExpertMLP (moe_shared_expert_intermediate_size)
    untied embeddings / lm_head               GPTModel(share_embeddings_and_output_weights=tie_word_embeddings)
Precision: "bf16" builds upstream linears; "nvfp4" swaps in NVFP4 linears/experts for every module role the
recipe does not keep in BF16 (recipe.bf16_modules, bf16_first_layers, bf16_last_layers). Router, embeddings,
lm_head and the attention math (softmax(QK^T)V) always stay BF16: this builder has no NVFP4 version of them.
Core attention: upstream's unfused DotProductAttention, except on a GPU: a whole-sequence causal pass (the learner's
training forward, the rollout's prefill) and a one-position decode step over the KV cache (Megatron passes no mask
then: the one query sees every cached key) run torch's scaled_dot_product_attention (the backend torch picks: a decode
step ran cuDNN's flash kernel on an H100 with torch 2.11, docs/benchmarks/decode-kernels-1024-h100.json; no score
matrix materialised; and, unlike upstream's path, no fork of Megatron's CUDA RNG tracker for a dropout of 0, which
CUDA-graph capture refuses). Explicit masks, multi-position steps over a cache and CPU runs keep upstream's path.
No dropout (RL on-policy forward passes must be deterministic); router aux loss 0 unless asked. With TP > 1 the
config turns on sequence parallelism (Megatron refuses MoE + TP training without it), so the sequence length must
be a multiple of TP (the learner pads); `set_sequence_parallel(model, False)` turns it off for a forward that has to
see whole sequences on every TP rank (a decode step, `minite diagnose`'s learner forward), as Megatron's static
inference does.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from minite.models.qwen3_moe import Qwen3MoeShape

from .nvfp4_layers import GroupedExperts, NVFP4ColumnParallelLinear, NVFP4Context, NVFP4RowParallelLinear
from .rope import install as install_rope_dispatch


def transformer_config(shape: Qwen3MoeShape, *, compute_dtype: torch.dtype = torch.bfloat16, tp: int = 1,
                       ep: int = 1, init_std: float = 0.02, router_aux_loss_coeff: float = 0.0) -> TransformerConfig:
    """Megatron TransformerConfig for the shape (CPU-friendly: no fusions, CPU init, no dropout)."""
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"compute_dtype must be bfloat16 or float32, got {compute_dtype}")
    if tp > 1 and ep > 1:
        raise ValueError("tp > 1 together with ep > 1 is not supported yet (untested); use one of them")
    if shape.moe_router_topk == 1 and shape.norm_topk_prob:
        raise ValueError("moe_router_topk=1 with norm_topk_prob=True gives every token weight 1 and the router no "
                         "gradient (Megatron refuses it); set norm_topk_prob=False")
    if shape.num_experts % ep:
        raise ValueError(f"num_experts={shape.num_experts} is not divisible by ep={ep}")
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.moe_ffn_hidden_size, normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        qk_layernorm=True, add_bias_linear=False, add_qkv_bias=False, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=shape.shared_expert_intermediate_size or None,
        moe_router_pre_softmax=not shape.norm_topk_prob, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if router_aux_loss_coeff else "none",
        moe_aux_loss_coeff=router_aux_loss_coeff, moe_token_dispatcher_type="alltoall",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1, bf16=compute_dtype == torch.bfloat16, params_dtype=compute_dtype,
        pipeline_dtype=compute_dtype, use_cpu_initialization=True, perform_initialization=True,
        init_method_std=init_std, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, moe_permute_fusion=False,
    )


def set_sequence_parallel(model: torch.nn.Module, on: bool) -> None:
    """Sequence parallelism of a built TP > 1 model on or off, with Megatron's `set_model_to_sequence_parallel` (the
    config's flag and every module's sequence-parallel attributes; the parameters' own `sequence_parallel` marks,
    which finalize_model_grads reads, stay). Off: every TP rank runs the whole sequence through every layer. With
    expert TP 1 (this builder's) the MoE layers take the whole sequence as well as a shard of it: their
    dispatcher's groups span the expert TP x EP ranks, not the dense TP ranks (docs/upstream.md). No-op at TP 1."""
    from megatron.core.transformer.utils import set_model_to_sequence_parallel
    from megatron.core.utils import get_model_config, unwrap_model

    if get_model_config(unwrap_model(model)).tensor_model_parallel_size > 1:
        set_model_to_sequence_parallel(unwrap_model(model), on)


@contextlib.contextmanager
def sequence_parallel_off(model: torch.nn.Module):
    """`set_sequence_parallel(model, False)` for the duration, then as it was (a no-grad forward of the learner whose
    ops must line up position by position with a rollout engine's: `minite diagnose`)."""
    from megatron.core.utils import get_model_config, unwrap_model

    was = get_model_config(unwrap_model(model)).sequence_parallel
    set_sequence_parallel(model, False)
    try:
        yield model
    finally:
        set_sequence_parallel(model, was)


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor, usable with sequence parallelism.

    Upstream's WrappedTorchNorm refuses sequence parallelism only because something must all-reduce the weight
    gradient over TP ranks (each rank normalises a different slice of the sequence); marking the weight
    `sequence_parallel` makes Megatron's finalize_model_grads do exactly that, as it does for TE's norms.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                   causal: bool = True) -> torch.Tensor:
    """Attention with torch's SDPA: q [s, b, np, hn], k/v [s_k, b, ng, hn] (query head i reads group i // (np / ng),
    as upstream's repeat_interleave) -> [s, b, np * hn], the layout DotProductAttention returns. causal: over a whole
    sequence (s = s_k), the groups repeated as upstream does; else every query sees every key (a decode step's one
    query): the np / ng query heads of a group are that group's queries, so the cache is read in place (not two
    copies of the whole cache, each np / ng times larger, per layer and step)."""
    rep = query.shape[2] // key.shape[2]
    if not causal and query.shape[0] == 1:
        b, ng, hn = query.shape[1], key.shape[2], query.shape[3]
        q = query[0].view(b, ng, rep, hn)  # [b, groups, queries of the group, hn]
        k, v = (t.permute(1, 2, 0, 3) for t in (key, value))  # [b, groups, s_k, hn]
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return out.reshape(1, b, ng * rep * hn)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class FusedDotProductAttention(DotProductAttention):
    """DotProductAttention that takes torch SDPA on a GPU for whole-sequence causal passes and one-query decode steps
    over the KV cache (module docstring)."""

    def _sdpa_mode(self, query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
        """"causal" (a whole sequence), "decode" (one query over the KV cache, no mask) or None (upstream's path)."""
        cfg = self.config
        if not (query.is_cuda and attention_mask is None and attention_bias is None and packed_seq_params is None
                and self.attn_mask_type == AttnMaskType.causal and self.softmax_offset is None
                and not cfg.apply_query_key_layer_scaling and cfg.window_size is None
                and (self.attention_dropout.p == 0.0 or not self.training)):
            return None
        if attn_mask_type in (None, AttnMaskType.causal) and query.shape[0] == key.shape[0]:
            return "causal"
        if attn_mask_type == AttnMaskType.no_mask and query.shape[0] == 1 and not self.training:
            return "decode"
        return None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mode = self._sdpa_mode(query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if mode is not None:
            return sdpa_attention(query, key, value, self.softmax_scale, causal=mode == "causal")
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)


def _linear(cls_bf16, cls_nvfp4, ctx: Optional[NVFP4Context]):
    return cls_bf16 if ctx is None else ModuleSpec(module=cls_nvfp4, params={"nvfp4": ctx})


def layer_spec(*, attention: Optional[NVFP4Context], mlp: Optional[NVFP4Context],
               experts: Optional[NVFP4Context]) -> ModuleSpec:
    """One Qwen3-MoE decoder layer; each role is NVFP4 when given a context, BF16 when None."""
    col = _linear(ColumnParallelLinear, NVFP4ColumnParallelLinear, mlp)
    row = _linear(RowParallelLinear, NVFP4RowParallelLinear, mlp)
    moe = ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=GroupedExperts, params={"nvfp4": experts}),
            shared_experts=ModuleSpec(module=SharedExpertMLP,
                                      submodules=MLPSubmodules(linear_fc1=col, linear_fc2=row)),
        ),
    )
    attn = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=_linear(ColumnParallelLinear, NVFP4ColumnParallelLinear, attention),
            core_attention=FusedDotProductAttention,
            linear_proj=_linear(RowParallelLinear, NVFP4RowParallelLinear, attention),
            q_layernorm=RMSNorm, k_layernorm=RMSNorm,
        ),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=attn, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm, mlp=moe, mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(num_layers: int, ctx: Optional[NVFP4Context]) -> TransformerBlockSubmodules:
    """Per-layer specs: BF16 everywhere when ctx is None, else NVFP4 per ctx.recipe's BF16 exceptions."""
    specs = []
    for i in range(num_layers):
        keep = ctx is None or i < ctx.recipe.bf16_first_layers or i >= num_layers - ctx.recipe.bf16_last_layers
        bf16 = set(ctx.recipe.bf16_modules) if ctx is not None else set()
        role = lambda name: None if keep or name in bf16 else ctx  # noqa: E731
        specs.append(layer_spec(attention=role("attention_linears"), mlp=role("mlp"), experts=role("experts")))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def number_nvfp4_layers(model: torch.nn.Module) -> int:
    """Give every NVFP4 module its `nvfp4_layer_id` (module order; identical on every rank); returns the count."""
    n = 0
    for module in model.modules():
        if hasattr(module, "nvfp4_layer_id"):
            module.nvfp4_layer_id = n
            n += 1
    return n


def build_gpt_model(shape_src: Union[Qwen3MoeShape, dict, str, Path, object], *, precision: str = "bf16",
                    ctx: Optional[NVFP4Context] = None, compute_dtype: torch.dtype = torch.bfloat16,
                    tp: int = 1, ep: int = 1, init_std: float = 0.02, router_aux_loss_coeff: float = 0.0,
                    pg_collection=None) -> GPTModel:
    """A Qwen3-MoE GPTModel (needs Megatron parallel state initialised). precision: "bf16" or "nvfp4"."""
    if precision not in ("bf16", "nvfp4"):
        raise ValueError(f"precision must be 'bf16' or 'nvfp4', got {precision!r}")
    if precision == "nvfp4":
        ctx = ctx or NVFP4Context()
        always = {"embedding", "router", "output_layer"}
        if not always <= set(ctx.recipe.bf16_modules):
            raise ValueError(f"recipe.bf16_modules must include {sorted(always)}: "
                             "NVFP4 embeddings, router and lm_head are not implemented")
    shape = shape_src if isinstance(shape_src, Qwen3MoeShape) else Qwen3MoeShape.from_any(shape_src)
    config = transformer_config(shape, compute_dtype=compute_dtype, tp=tp, ep=ep, init_std=init_std,
                                router_aux_loss_coeff=router_aux_loss_coeff)
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(shape.num_layers, ctx if precision == "nvfp4" else None),
        vocab_size=shape.vocab_size, max_sequence_length=shape.max_position_embeddings,
        parallel_output=True, share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta), pg_collection=pg_collection,
    )
    number_nvfp4_layers(model)
    model.nvfp4_context = ctx if precision == "nvfp4" else None
    install_rope_dispatch()  # rollout decode steps: Megatron's RoPE arithmetic in one launch (megatron_patches.rope)
    return model
