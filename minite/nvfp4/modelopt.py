"""The ModelOpt NVFP4 checkpoint layout: what stock SGLang / vLLM load as `modelopt_fp4`, and how our recipe rides
along in its hf_quant_config.json.

Per quantised linear (experts: w13_* / w2_* in SGLang's fused-MoE naming):
    weight          uint8 [N, K/2]           E2M1 codes, even element in the low nibble
    weight_scale    float8_e4m3fn [N, K/16]  one scale per 1x16 block along K
    weight_scale_2  fp32, one per logical shard (q/k/v, gate/up): the global decode scale
    input_scale     fp32, one per shard: a static activation scale (ModelOpt's); miniTE quantises activations per
                    row on the fly, so it is written for compatibility and not read
hf_quant_config.json: {"producer", "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules"}}, plus
a "minite" section (the activation recipe) that ModelOpt and SGLang ignore.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .recipe import NVFP4Recipe, OperandRecipe

GROUP = 16


def recipe_to_json(recipe: NVFP4Recipe) -> dict:
    """The part of the recipe the forward pass uses (activation quantisation), for hf_quant_config.json."""
    act = recipe.activation
    return {"activation": {"block": list(act.block), "scale_scope": act.scale_scope, "rounding": act.rounding,
                           "rht": act.rht},
            "weight_block_trained": list(recipe.weight.block)}


def recipe_from_json(d: Optional[dict]) -> NVFP4Recipe:
    """Inverse of recipe_to_json; defaults (per-row 1x16 activations) when absent."""
    if not d or "activation" not in d:
        return NVFP4Recipe()
    a = d["activation"]
    return NVFP4Recipe(activation=OperandRecipe(block=tuple(a["block"]), scale_scope=a["scale_scope"],
                                                rounding=a["rounding"], rht=a["rht"]))


def quant_config_dict(recipe: NVFP4Recipe, exclude_modules: List[str]) -> Dict[str, Any]:
    """hf_quant_config.json content: ModelOpt's NVFP4 schema plus a 'minite' section SGLang/ModelOpt ignore."""
    return {
        "producer": {"name": "modelopt", "version": "minite-export"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                         "exclude_modules": list(exclude_modules)},
        "minite": recipe_to_json(recipe),
    }
