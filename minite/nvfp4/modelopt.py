"""The ModelOpt NVFP4 checkpoint layout: what stock SGLang / vLLM load as `modelopt_fp4`, and how our recipe rides
along in its hf_quant_config.json.

Per quantised linear (experts: w13_* / w2_* in SGLang's fused-MoE naming):
    weight          uint8 [N, K/2]           E2M1 codes, even element in the low nibble
    weight_scale    float8_e4m3fn [N, K/16]  one scale per 1x16 block along K
    weight_scale_2  fp32, one per logical shard (q/k/v, gate/up): ModelOpt's decode scale fl(amax / 2688)
    weight_scale_amax  fp32, one per shard: the amax itself (miniTE's export adds it; stock loaders skip the name),
                    because the GEMM's alpha needs the amax exactly and fl(amax / 2688) does not determine it
    input_scale     fp32, one per shard: a static activation scale (ModelOpt's); miniTE quantises activations per
                    row on the fly, so it is written for compatibility and not read
Reading (`weight_tensor`, `expert_stack`) views the loaded tensors as NVFP4Tensor / NVFP4Stack without copying;
writing is minite.convert.export_nvfp4 (it quantises with the learner's op functions, a layer above this one).
hf_quant_config.json: {"producer", "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules"}}, plus
a "minite" section (the activation recipe) that ModelOpt and SGLang ignore.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .grouped import NVFP4Stack
from .recipe import NVFP4Recipe, OperandRecipe
from .tensor import NVFP4Tensor

GROUP = 16


def scale_grid_1x16(q: NVFP4Tensor) -> torch.Tensor:
    """The block scales of q as a 1x16 grid [N, K/16] (a 16x16 grid's rows repeated; exact: same e4m3 bits)."""
    br = q.block[0]
    s = q.scale.view(torch.uint8)
    return s.repeat_interleave(br, dim=0).view(torch.float8_e4m3fn).contiguous() if br > 1 else q.scale


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


def _global_scales(scale_2: torch.Tensor, rows: int, shard_sizes: Optional[List[int]] = None,
                   amax: Optional[torch.Tensor] = None) -> tuple:
    """(decode scales, amaxes) from ModelOpt's per-shard weight_scale_2 [..., S] and our per-shard amax [..., S]
    (NaN where the checkpoint had none: then fl(scale_2 * 2688)). Both [...] when every shard's pair agrees
    everywhere (every export of ours: the learner's fused QKV / gate-up weight has one amax), else per-row
    [..., rows], each shard's value repeated over its rows (exact as well: the GEMM's alpha is formed per output
    column from amax_w[n])."""
    s2 = scale_2.float()
    am = s2 * 2688.0 if amax is None else torch.where(torch.isnan(amax.float()), s2 * 2688.0, amax.float())
    pair = torch.stack([s2, am])
    if s2.shape[-1] == 1 or bool((pair == pair[..., :1]).all()):
        return s2[..., 0].contiguous(), am[..., 0].contiguous()
    sizes = torch.tensor(shard_sizes or [rows // s2.shape[-1]] * s2.shape[-1], device=s2.device)
    return (torch.repeat_interleave(s2, sizes, dim=-1).contiguous(),
            torch.repeat_interleave(am, sizes, dim=-1).contiguous())


def weight_tensor(data: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                  shard_sizes: Optional[List[int]] = None, amax: Optional[torch.Tensor] = None) -> NVFP4Tensor:
    """An NVFP4Tensor [N, K] over ModelOpt-layout tensors (no copy of codes or scales); scale_2 and amax hold one
    value per logical shard (`_global_scales`). Its global_scale is weight_scale_2 (a weight is never requantised
    here; the GEMM and dequantize() read the amax)."""
    n, k = data.shape[0], data.shape[1] * 2
    gs, am = _global_scales(scale_2.reshape(-1), n, shard_sizes, None if amax is None else amax.reshape(-1))
    return NVFP4Tensor(data, scale, gs, (n, k), (1, GROUP), amax=am)


def expert_stack(data: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                 amax: Optional[torch.Tensor] = None) -> NVFP4Stack:
    """The experts of a FusedMoE layer as one NVFP4Stack over its stacked ModelOpt tensors (no copy of codes or
    scales): data [E, N, K/2], scale [E, N, K/16], scale_2 and amax [E] or [E, shards] (`_global_scales`, decided
    for all experts at once). The grouped kernels read it directly instead of stacking E tensors per call."""
    e, n = data.shape[0], data.shape[1]
    gs, am = _global_scales(scale_2.reshape(e, -1), n, None, None if amax is None else amax.reshape(e, -1))
    return NVFP4Stack(data, scale, gs, (n, data.shape[2] * 2), (1, GROUP), amax=am)
