"""Reading a Hugging Face Qwen3-MoE config.json: one parser for the learner's spec builder and the converter.

Both spellings are read: the Hub's (num_experts, top-level rope_theta) and the one transformers 5 writes with
save_pretrained (num_local_experts, rope_parameters.rope_theta). Dependency-free, so `minite convert --help` and the
converter do not import Megatron-Core.
"""
from __future__ import annotations


def qwen3_moe_fields(hf: dict, where: str = "config.json") -> dict:
    """The architecture numbers under the learner's names (minite.config.ModelConfig / Qwen3MoeShape).

    ValueError naming `where` and the field for a missing field or a layout we do not support (dense layers).
    """
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
