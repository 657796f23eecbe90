"""The Qwen3-MoE model family: its one shape type and its Hugging Face config.json, read and written.

`Qwen3MoeShape` is the architecture every part of miniTE uses (the Megatron spec builder, the converter, the SGLang
engine's config.json, the scaling numbers); `minite.config.ModelConfig` is the YAML face of the same numbers.
config.json is read in both spellings: the Hub's (num_experts, top-level rope_theta) and the one transformers 5
writes with save_pretrained (num_local_experts, rope_parameters.rope_theta). Dependency-free (no Megatron-Core, no
transformers), so `minite convert --help` and the converter stay light.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path


HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok")
"""config.json's sizes: each, where present, an integer >= 1."""


def qwen3_moe_fields(hf: dict, where: str = "config.json") -> dict:
    """The architecture numbers under the learner's names (minite.config.ModelConfig / Qwen3MoeShape).

    ValueError naming `where` and the field for what is not a Qwen3-MoE config: not a JSON object, a missing field, a
    size that is not a positive integer, a layout we do not support (dense layers).
    """
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(hf).__name__}")
    for key in HF_SIZES:
        if hf.get(key) is not None and (type(hf[key]) is not int or hf[key] < 1):
            raise ValueError(f"{where}: {key} = {hf[key]!r}, expected an integer >= 1")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{where}: dense (mlp_only) layers are not supported; every layer must be MoE")
    try:
        heads = hf["num_attention_heads"]
        experts = hf["num_experts"] if hf.get("num_experts") is not None else hf["num_local_experts"]
        rope = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 1e6))
        return dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            moe_ffn_hidden_size=hf["moe_intermediate_size"], num_experts=experts,
            moe_router_topk=hf["num_experts_per_tok"],
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=hf.get("norm_topk_prob", True), rope_theta=float(rope),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing Qwen3-MoE field {e.args[0]!r}") from None


@dataclass(kw_only=True)
class Qwen3MoeShape:
    """The architecture numbers a Qwen3-MoE model needs (Hugging Face names in comments)."""

    vocab_size: int
    hidden_size: int
    num_layers: int                       # num_hidden_layers
    num_attention_heads: int
    num_query_groups: int                 # num_key_value_heads
    head_dim: int
    moe_ffn_hidden_size: int              # moe_intermediate_size
    num_experts: int
    moe_router_topk: int                  # num_experts_per_tok
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    @classmethod
    def from_any(cls, src) -> "Qwen3MoeShape":
        """From a config.json path, a HF dict / PretrainedConfig, or an object with our field names."""
        if isinstance(src, (str, Path)):
            try:
                hf = json.loads(Path(src).read_text())
            except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"{src}: not a JSON file ({e})") from None
            return cls(**qwen3_moe_fields(hf, str(src)))
        if not isinstance(src, dict) and hasattr(src, "to_dict") and hasattr(src, "num_hidden_layers"):
            src = src.to_dict()
        if isinstance(src, dict) and "num_hidden_layers" in src:
            return cls._from_hf(src)
        names = [f.name for f in fields(cls)]
        get = src.get if isinstance(src, dict) else (lambda k, d=None: getattr(src, k, d))
        missing = [n for n in names[:9] if get(n) is None]
        if missing:
            raise ValueError(f"Qwen3-MoE shape: missing fields {missing}")
        return cls(**{n: get(n) for n in names if get(n) is not None})

    @classmethod
    def _from_hf(cls, hf: dict) -> "Qwen3MoeShape":
        return cls(**qwen3_moe_fields(hf, "Qwen3-MoE config"))

    def to_hf(self) -> dict:
        """A Hugging Face Qwen3-MoE config.json for this shape (no bos/eos token ids: the tasks bring their own)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.moe_ffn_hidden_size, "moe_intermediate_size": self.moe_ffn_hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
            "num_experts": self.num_experts, "num_experts_per_tok": self.moe_router_topk,
            "norm_topk_prob": self.norm_topk_prob, "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False, "hidden_act": "silu",
            "bos_token_id": None, "eos_token_id": None, "use_sliding_window": False,
        }
