"""The model shapes the benchmarks build: Qwen3-30B-A3B's full width (examples/qwen3_30b_a3b/config.json read through
the one shape type, minite.models.qwen3_moe.Qwen3MoeShape) and a tiny one for CPU smoke runs, as `model.*` config
keys (the layer count is each benchmark's own argument)."""
from __future__ import annotations

from pathlib import Path

from minite.models.qwen3_moe import Qwen3MoeShape

KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "num_experts",
        "moe_router_topk", "moe_ffn_hidden_size")
_QWEN3_30B_A3B = Qwen3MoeShape.from_any(Path(__file__).resolve().parents[2] / "examples" / "qwen3_30b_a3b" /
                                        "config.json")
FULL = {k: getattr(_QWEN3_30B_A3B, k) for k in KEYS}
TINY = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
