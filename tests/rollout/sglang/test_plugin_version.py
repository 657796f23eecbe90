"""The minite_nvfp4 plugin is pinned to one SGLang version and says so when it meets another (no SGLang needed);
under SGLang's PyTorch fused ops it turns Qwen3-MoE's fused RoPE + KV-cache write off (SGLang needed)."""
from __future__ import annotations

import importlib.metadata

import pytest


def test_other_sglang_version_fails_with_a_clear_message(monkeypatch):
    from minite.rollout.sglang import common, plugin

    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(common.importlib.metadata, "version", lambda name: "0.5.22")
    with pytest.raises(common.SGLangVersionError, match=r"sglang==0\.5\.23 only.*found sglang==0\.5\.22"):
        plugin.register()


def test_missing_sglang_fails_with_a_clear_message(monkeypatch):
    from minite.rollout.sglang import common

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(common.importlib.metadata, "version", missing)
    with pytest.raises(common.SGLangVersionError, match="not installed.*tools/setup.sh"):
        common.check_sglang_version()


def test_recipe_round_trips_through_hf_quant_config():
    from minite.nvfp4 import NVFP4Recipe, OperandRecipe
    from minite.nvfp4.modelopt import quant_config_dict, recipe_from_json

    r = NVFP4Recipe(activation=OperandRecipe(block=(1, 16), scale_scope="tensor"))
    back = recipe_from_json(quant_config_dict(r, ["lm_head"])["minite"])
    assert back.activation == r.activation
    assert recipe_from_json(None).activation.scale_scope == "row"


def test_torch_fused_ops_turn_the_fused_kv_write_off(monkeypatch):
    """Under SGLANG_FORCE_FUSED_OP_BACKEND=torch Qwen3-MoE's fused RoPE + KV write is off (the PyTorch RoPE cannot
    write the cache); otherwise SGLang's own choice stays."""
    pytest.importorskip("sglang")
    import sglang.srt.models.qwen3_moe as qwen3_moe

    from minite.rollout.sglang.plugin import torch_rope_stores_kv

    monkeypatch.setattr(qwen3_moe, "enable_fused_set_kv_buffer", qwen3_moe.enable_fused_set_kv_buffer)
    upstream = qwen3_moe.enable_fused_set_kv_buffer
    monkeypatch.delenv("SGLANG_FORCE_FUSED_OP_BACKEND", raising=False)
    assert not torch_rope_stores_kv() and qwen3_moe.enable_fused_set_kv_buffer is upstream
    monkeypatch.setenv("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")
    assert torch_rope_stores_kv() and qwen3_moe.enable_fused_set_kv_buffer(object()) is False
