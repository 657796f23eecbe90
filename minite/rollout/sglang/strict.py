"""Strict mode inside SGLang 0.5.23: its Qwen3-MoE forward computed with the learner's batch-invariant ops.

Why. With `alignment.strict` the learner (megatron_patches.strict) computes every forward op with
minite.strict.ops, whose outputs are fixed functions of their own inputs whatever the batch, row position
or number of keys. SGLang computes the same model with its own kernels (RMSNorm with a fused residual add, torch's
SDPA per request, its TopK, a vocab-sized torch log_softmax), which are not batch invariant and do not round like
the learner's: measured default gap on the tiny CPU model, max 3.2e-2 / mean 4.9e-3 (docs/alignment.md). This
module makes SGLang run, in strict mode, the learner's op sequence with the learner's strict ops, so the gap is 0.

What is replaced (only while strict mode is active in the process; otherwise every patch calls upstream):

| upstream (sglang 0.5.23)                            | strict replacement (same order and dtypes as Megatron's) |
|-----------------------------------------------------|-----------------------------------------------------------|
| Qwen3MoeModel.forward (models/qwen3_moe.py; the     | `_model_forward`: embedding lookup; per layer             |
| decoder layers, their communicator/fused residual   | h = h + attn(rms_norm(h)), h = h + moe(rms_norm(h)), the  |
| RMSNorm, qk-norm + RoPE, TopK, FusedMoE, final norm)| adds in the activation dtype (Megatron's bias-dropout-add);|
|                                                     | strict rms_norm (input, post-attention, q/k, final);      |
|                                                     | RoPE: Megatron's inv_freq and position * inv_freq table,  |
|                                                     | then minite.strict.ops.rope (strict sincos);             |
|                                                     | router: fp32 strict linear, strict softmax/top-k (ties to |
|                                                     | the lower index), as strict._router_forward;              |
|                                                     | experts: the plugin's NVFP4 grouped GEMMs, strict SiLU,   |
|                                                     | combine summed per token in ascending expert order, fp32  |
| TorchNativeAttnBackend._run_sdpa_forward_extend /   | S.attention per request over the request's KV    |
| _run_sdpa_forward_decode (torch SDPA per request)   | cache, by absolute position (prefill = full = decode)     |
| LogitsProcessor._compute_lm_head (F.linear/matmul)  | S.linear, output in the activation dtype         |
| Sampler.forward's returned token log-probs          | S.log_softmax of the logits before temperature   |
|   (torch log_softmax)                               | (the learner's token_logprobs); sampling itself unchanged |

NVFP4 linears (q/k/v/o) and expert GEMMs stay the plugin's (minite_nvfp4: the learner's own op functions, exact);
BF16 linears (a BF16 checkpoint, or modules the NVFP4 export keeps BF16) become S.linear, BF16 experts a
S.linear per expert (the learner's strict GroupedExperts in BF16).

How it is switched on. The plugin's entry point (`plugin.register`, run in every SGLang process) calls
`install()`, which puts dispatchers in place once (idempotent, logged). A Qwen3MoeModel whose config carries
`minite_strict: true` (config.json, written by engine.build_sglang when cfg.alignment.strict; SGLang keeps
unknown config.json keys as config attributes) runs `_model_forward` and marks the process strict for the
attention, lm_head and log-prob steps that follow it; any other model runs upstream's code and clears the mark. One
model per SGLang scheduler process, so the mark is the model's. NVFP4 or BF16 checkpoint alike.

Scope: sglang==0.5.23 only (the plugin refuses other versions: these are private SGLang methods);
attention_backend="torch_native" (the CPU engine's; on a GPU build_sglang selects it with CUDA graphs off, and
`_model_forward` raises for any other backend), TP = EP = PP = 1, Qwen3-MoE without shared experts, softmax top-k router
(norm_topk_prob=True: top-k of the logits then softmax over the k; False: softmax then top-k, as the learner's
moe_router_pre_softmax = not norm_topk_prob). The radix cache may stay on: a cached prefix holds the same strict
K/V bits a recomputation would give. Strict ops must run eagerly (no torch.compile / CUDA graphs).

Measured (CPU, 2 cores, docs/alignment.md): `minite diagnose --b sglang --set alignment.strict=true` gives max
|logp gap| exactly 0 on the tiny model in NVFP4 (default mode: 3.2e-2) and BF16 (default: 2.3e-3), and on a wider
3-layer model (default: 9.2e-2 NVFP4, 1.5e-2 BF16); generating 16 prompts x 8 tokens on the tiny NVFP4 model takes
about 3x the default engine's time (0.35 s vs 0.12 s).
"""
from __future__ import annotations

import logging
import math

import torch

from minite.ops import grouped_linear_bf16, routed_experts
from minite.strict import ops as S

from .common import check_sglang_version, grouped_forward

log = logging.getLogger(__name__)

_ACTIVE = False
_INSTALLED = False


def is_active() -> bool:
    return _ACTIVE


def set_active(active: bool) -> None:
    """Mark this process strict (or not) for the attention, lm_head and log-prob dispatchers; the model's forward
    does this on every call (module docstring)."""
    global _ACTIVE
    if bool(active) != _ACTIVE:
        log.info("minite strict mode for SGLang: %s", "on" if active else "off")
    _ACTIVE = bool(active)


# --------------------------------------------------------------------------------------------------------------
# The strict model forward
# --------------------------------------------------------------------------------------------------------------

def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An SGLang linear: the plugin's NVFP4 method as it is; an unquantized (BF16) one through S.linear."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
        y = S.linear(x, module.weight, out_dtype=x.dtype)
        return y + module.bias if getattr(module, "bias", None) is not None else y
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _rope_table(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """Megatron's RotaryEmbedding (0.16.1): inv_freq = 1 / base ** (arange(0, d, 2) / d) in fp32, freqs =
    position * inv_freq, emb = cat(freqs, freqs); returned as [T, 1, d]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)[:, None, :]


def _attention_block(attn, x: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
    """Qwen3MoeAttention: qkv, per-head q/k strict RMSNorm, strict RoPE, RadixAttention (strict backend), o_proj."""
    t = x.shape[0]
    qkv = _linear(attn.qkv_proj, x)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    d = attn.head_dim
    q = S.rms_norm(q.reshape(t, -1, d), attn.q_norm.weight, attn.q_norm.variance_epsilon)
    k = S.rms_norm(k.reshape(t, -1, d), attn.k_norm.weight, attn.k_norm.variance_epsilon)
    emb = _rope_table(positions.reshape(-1), d, float(attn.rope_theta))
    q = S.rope(q, emb).reshape(t, -1)
    k = S.rope(k, emb).reshape(t, -1)
    o = attn.attn(q, k, v.contiguous(), forward_batch, save_kv_cache=True)
    return _linear(attn.o_proj, o)


def _moe_block(block, x: torch.Tensor, pre_softmax: bool) -> torch.Tensor:
    """Qwen3MoeSparseMoeBlock as minite.megatron_patches.strict's router + experts + combine compute it."""
    from .methods import MiniteNVFP4MoEMethod  # imports SGLang

    method = block.experts.quant_method
    k = block.topk.topk_config.top_k
    logits = S.linear(x.float(), block.gate.weight.float())
    if pre_softmax:
        probs_k, idx = S.topk(S.softmax(logits), k)
    else:
        vals, idx = S.topk(logits, k)
        probs_k = S.softmax(vals)
    if isinstance(method, MiniteNVFP4MoEMethod):
        w13, w2 = method.experts(block.experts)
        return grouped_forward(x, w13, w2, probs_k, idx, method.config.recipe, method.config.backend, strict=True)
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        raise ValueError(f"strict SGLang: experts must be minite_nvfp4 or BF16, got {type(method).__name__}")
    weights = (block.experts.w13_weight, block.experts.w2_weight)
    return routed_experts(x, idx, probs_k, weights[0].shape[0],
                          lambda a, i, counts: grouped_linear_bf16(a, weights[i], counts, strict=True), strict=True)


def _model_forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
    """Qwen3MoeModel.forward in strict mode (module docstring); pipeline parallelism is not supported."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import get_attn_backend

    if not (self.pp_group.is_first_rank and self.pp_group.is_last_rank):
        raise ValueError("strict SGLang: pipeline parallelism is not supported")
    backend = get_attn_backend()
    if not isinstance(backend, TorchNativeAttnBackend):
        raise ValueError("strict SGLang needs attention_backend='torch_native' (its per-request attention is the "
                         f"one replaced), got {type(backend).__name__}")
    h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
    pre_softmax = not getattr(self.config, "norm_topk_prob", True)
    for i in range(self.start_layer, self.end_layer):
        layer = self.layers[i]
        if h.shape[0] == 0:
            break
        x = S.rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        h = h + _attention_block(layer.self_attn, x, positions, forward_batch)
        x = S.rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        h = h + _moe_block(layer.mlp, x, pre_softmax)
    return S.rms_norm(h, self.norm.weight, self.norm.variance_epsilon)


# --------------------------------------------------------------------------------------------------------------
# Attention over the KV cache, lm_head, returned log-probs
# --------------------------------------------------------------------------------------------------------------

def _request_attention(q, k_cache, v_cache, tokens, scale: float) -> torch.Tensor:
    """q [sq, h, d] at the last sq positions of a request whose K/V cache slots are `tokens` -> [sq, h, d] fp32."""
    k, v = k_cache[tokens], v_cache[tokens]                          # [sk, hkv, d]: S.attention reads the groups
    return S.attention(q[:, None], k[:, None].to(q.dtype), v[:, None].to(q.dtype), scale)[:, 0]


def _strict_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)  # Megatron's DotProductAttention softmax_scale


def _check_plain(sliding_window_size, encoder_lens, causal=True):
    if (sliding_window_size is not None and sliding_window_size > -1) or encoder_lens is not None or not causal:
        raise ValueError("strict SGLang attention: causal decoder self-attention only")


def _sdpa_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                 causal=False, is_cross_attn=False, sliding_window_size=None):
    _check_plain(sliding_window_size, encoder_lens, causal)
    start = 0
    for i in range(seq_lens.shape[0]):
        n, sk = int(extend_seq_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :sk]
        ctx = _request_attention(query[start:start + n], k_cache, v_cache, tokens, _strict_scale(query.shape[-1]))
        output[start:start + n] = ctx.to(output.dtype)
        start += n
    return output


def _sdpa_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                 sliding_window_size=None):
    _check_plain(sliding_window_size, encoder_lens)
    for i in range(seq_lens.shape[0]):
        tokens = req_to_token[req_pool_indices[i], :int(seq_lens[i])]
        ctx = _request_attention(query[i:i + 1], k_cache, v_cache, tokens, _strict_scale(query.shape[-1]))
        output[i:i + 1] = ctx.to(output.dtype)
    return output


def _lm_head(self, hidden_states, lm_head, embedding_bias=None, *, out=None):
    if embedding_bias is not None:
        raise ValueError("strict SGLang: lm_head bias is not supported")
    return S.linear(hidden_states, lm_head.weight, out_dtype=hidden_states.dtype)


def _wrap_sampler_forward(upstream):
    def forward(self, logits_output, sampling_info, return_logprob, *args, **kwargs):
        if not _ACTIVE or not return_logprob:
            return upstream(self, logits_output, sampling_info, return_logprob, *args, **kwargs)
        logp = S.log_softmax(logits_output.next_token_logits, -1)  # before the sampler scales logits in place
        ids = upstream(self, logits_output, sampling_info, return_logprob, *args, **kwargs)
        rows = torch.arange(ids.shape[0], device=ids.device)
        logits_output.next_token_logprobs = logp[rows, ids.long()].clamp(min=torch.finfo(logp.dtype).min)
        return ids
    return forward


def _dispatch(upstream, strict_fn):
    def method(self, *args, **kwargs):
        return (strict_fn if _ACTIVE else upstream)(self, *args, **kwargs)
    method._minite_strict_dispatch = True
    method.__name__ = getattr(upstream, "__name__", "method")
    return method


def install() -> None:
    """Install the dispatchers (idempotent); each runs upstream's code unless strict mode is active."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_sglang_version()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.models.qwen3_moe import Qwen3MoeModel

    patched = []
    if not getattr(Qwen3MoeModel.forward, "_minite_strict_dispatch", False):
        upstream_model = Qwen3MoeModel.forward

        def forward(self, *args, **kwargs):
            strict = bool(getattr(self.config, "minite_strict", False))
            set_active(strict)
            return (_model_forward if strict else upstream_model)(self, *args, **kwargs)

        forward._minite_strict_dispatch = True
        Qwen3MoeModel.forward = forward
        patched.append("Qwen3MoeModel.forward")
    for cls, name, fn in ((TorchNativeAttnBackend, "_run_sdpa_forward_extend", _sdpa_extend),
                          (TorchNativeAttnBackend, "_run_sdpa_forward_decode", _sdpa_decode),
                          (LogitsProcessor, "_compute_lm_head", _lm_head)):
        upstream = getattr(cls, name)
        if not getattr(upstream, "_minite_strict_dispatch", False):
            setattr(cls, name, _dispatch(upstream, fn))
            patched.append(f"{cls.__name__}.{name}")
    if not getattr(Sampler.forward, "_minite_strict_dispatch", False):
        wrapped = _wrap_sampler_forward(Sampler.forward)
        wrapped._minite_strict_dispatch = True
        Sampler.forward = wrapped
        patched.append("Sampler.forward")
    _INSTALLED = True
    log.info("minite strict mode for SGLang: patched %s", ", ".join(patched))
