"""SGLang plugin: quantization method `minite_nvfp4`, computing with the learner's own NVFP4 op functions.

What it changes in SGLang (0.5.23 only; any other version raises `SGLangVersionError` at registration):
- registers `MiniteNVFP4Config` under the name "minite_nvfp4" in sglang.srt.layers.quantization's method tables
  (QUANTIZATION_METHODS first in order, see below; BASE_ and CPU_QUANTIZATION_METHODS) and as a CLI choice;
- appends "MiniteNVFP4LinearMethod" to sglang.srt.layers.linear.WEIGHT_LOADER_V2_SUPPORTED, so the linears load our
  parameters with the same (v2) loaders that ModelOpt's FP4 method uses;
- installs sglang_strict's dispatchers (idempotent): SGLang code runs unchanged except for a Qwen3-MoE model whose
  config.json says `"minite_strict": true` (written for cfg.alignment.strict), which then computes with the
  learner's strict ops (sglang_strict.py; with or without this quantization method).
Why first in QUANTIZATION_METHODS: SGLang asks every method, in table order, whether to override the user's choice
for a checkpoint; ModelOpt's methods claim every ModelOpt NVFP4 checkpoint. Ours answers first and claims it only
when the user asked for "minite_nvfp4", so `--quantization minite_nvfp4` loads a ModelOpt export and every other
choice behaves as before. The table is reordered in place (the same dict object), idempotently.
How it is loaded: setup.py's entry point `minite_nvfp4 = minite.rollout.sglang_plugin:register` in SGLang's general
plugin group `sglang.srt.plugins`; SGLang calls it early in every process it starts (engine, scheduler, workers).

Weights are stored exactly as a ModelOpt NVFP4 checkpoint names them (minite.convert.export_nvfp4):
    weight        uint8 [N, K/2]       E2M1 codes, even element in the low nibble
    weight_scale  float8_e4m3fn [N, K/16]   one scale per 1x16 block
    weight_scale_2  fp32, one per logical shard (q/k/v, gate/up)   ModelOpt's decode scale fl(amax / 2688)
    weight_scale_amax  fp32, one per shard   the amax itself (minite's export; stock loaders skip the name)
    input_scale   fp32, one per shard   loaded for compatibility, ignored: see below
The learner quantises weights in 16x16 blocks; a 16x16 scale grid repeated over its 16 rows *is* a 1x16 grid with
the same values, so `weight_tensor(weight, weight_scale, weight_scale_2, amax=weight_scale_amax)` has exactly the
learner's block values and amax, and the GEMM (`minite.nvfp4.gemm`: exact block products, then TE's alpha
(amax_x * amax_w) * fl(1/(6*6*448*448))) gives the same bits. Why the amax travels as its own tensor: the GEMM alpha
needs the amax exactly and fl(amax / 2688) does not determine it (dividing by 21 * 2^7 maps some neighbouring fp32
amaxes to one value). A checkpoint without it (a foreign ModelOpt export) gets amax = fl(weight_scale_2 * 2688),
within an ulp or so of its producer's amax (docs/nvfp4.md, docs/sglang.md).

Activations are quantised as the recipe says: 1x16 blocks with one global scale per row (token), computed on the fly
by `minite.learner.ops.nvfp4_linear_forward` (the forward the learner's nvfp4_linear runs). A token's quantisation
then depends on that token only, so rollout batches and training batches agree (shared/NOTES.md section 2). The
checkpoint's static `input_scale` is therefore not used by this plugin.

Experts: `MiniteNVFP4MoEMethod.apply` routes like Megatron's MoE layer does on the learner (tokens sorted by expert,
stable in token order; `nvfp4_grouped_linear` for fc1 and fc2; silu(gate) * up * router prob in fp32; the combine
adds each token's expert outputs in ascending expert order with scatter_add, as Megatron's unpermute does).
Backend: minite.nvfp4's "auto" (Triton on CUDA tensors, the exact reference on CPU), as the learner uses.
"""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, Dict, List, Optional

import torch

from minite.learner.ops import nvfp4_grouped_linear
from minite.nvfp4 import NVFP4Recipe, NVFP4Stack, NVFP4Tensor, OperandRecipe

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
METHOD_NAME = "minite_nvfp4"
GROUP = 16


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version this plugin was written and tested against."""


def check_sglang_version() -> str:
    """The installed SGLang version; raises SGLangVersionError unless it is exactly SGLANG_VERSION."""
    try:
        have = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise SGLangVersionError(f"sglang is not installed; the minite_nvfp4 plugin needs sglang=={SGLANG_VERSION} "
                                 "(tools/setup.sh installs it with its CPU-safe requirements)") from e
    if have != SGLANG_VERSION:
        raise SGLangVersionError(f"minite_nvfp4 supports sglang=={SGLANG_VERSION} only (it names SGLang's internal "
                                 f"layer and loader classes), found sglang=={have}")
    return have


_REGISTERED = False


def register() -> None:
    """The `sglang.srt.plugins` entry point: register quantization method "minite_nvfp4" (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    check_sglang_version()
    import sglang.srt.layers.linear as sgl_linear
    import sglang.srt.layers.quantization as sgl_quant

    config_cls = _config_class()
    table = sgl_quant.QUANTIZATION_METHODS
    rest = [(k, v) for k, v in table.items() if k != METHOD_NAME]
    table.clear()  # same dict object, ours first (module docstring)
    table[METHOD_NAME] = config_cls
    table.update(rest)
    sgl_quant.BASE_QUANTIZATION_METHODS[METHOD_NAME] = config_cls
    sgl_quant.CPU_QUANTIZATION_METHODS[METHOD_NAME] = config_cls
    if "MiniteNVFP4LinearMethod" not in sgl_linear.WEIGHT_LOADER_V2_SUPPORTED:
        sgl_linear.WEIGHT_LOADER_V2_SUPPORTED.append("MiniteNVFP4LinearMethod")
    try:
        from sglang.srt.arg_groups.choices import add_quantization_method_choices
        add_quantization_method_choices([METHOD_NAME])
    except ImportError:  # the CLI choice is a convenience; the offline Engine does not need it
        log.info("minite_nvfp4: sglang.srt.arg_groups.choices not found; CLI choice not added")
    from minite.rollout import sglang_strict

    sglang_strict.install()
    _REGISTERED = True
    log.info("minite_nvfp4: registered quantization method with sglang %s (linear + fused MoE)", SGLANG_VERSION)


# --------------------------------------------------------------------------------------------------------------
# Recipe <-> quantization config
# --------------------------------------------------------------------------------------------------------------

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


def _config_class():
    """MiniteNVFP4Config, defined on first use so that importing this module never imports SGLang."""
    global _CONFIG_CLS
    if _CONFIG_CLS is None:
        from minite.rollout import sglang_methods
        _CONFIG_CLS = sglang_methods.build_config_class()
    return _CONFIG_CLS


_CONFIG_CLS = None


def quant_config_dict(recipe: NVFP4Recipe, exclude_modules: List[str]) -> Dict[str, Any]:
    """hf_quant_config.json content: ModelOpt's NVFP4 schema plus a 'minite' section SGLang/ModelOpt ignore."""
    return {
        "producer": {"name": "modelopt", "version": "minite-export"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                         "exclude_modules": list(exclude_modules)},
        "minite": recipe_to_json(recipe),
    }


def grouped_forward(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, recipe: NVFP4Recipe, backend: str = "auto") -> torch.Tensor:
    """Routed SwiGLU experts on x [T, H] with top-k ids/weights [T, k], computed as the learner's MoE layer does.
    w13 / w2: NVFP4Stack (`expert_stack`) or lists of per-expert NVFP4Tensors.

    Permute (Megatron moe_utils.permute): rows sorted by expert, token order within an expert. Experts: the learner's
    GroupedExperts.forward (fc1, silu(gate) * up * prob in fp32, fc2). Combine (moe_utils.unpermute): scatter_add of
    each permuted row into its token, in permuted order, in x's dtype.
    """
    t, h = x.shape
    e = len(w13)
    routing = torch.zeros(t, e, dtype=torch.bool, device=x.device)
    routing.scatter_(1, topk_ids.long(), True)
    probs = torch.zeros(t, e, dtype=torch.float32, device=x.device)
    probs.scatter_(1, topk_ids.long(), topk_weights.float())
    rmap = routing.t().contiguous()
    sorted_idx = torch.arange(t, device=x.device).unsqueeze(0).expand(e, -1).masked_select(rmap)
    perm_probs = probs.t().contiguous().masked_select(rmap)
    counts = rmap.sum(dim=1).tolist()
    xp = x.index_select(0, sorted_idx)
    # weight= is only read for its shape when weight_q is given (no quantisation happens)
    hidden = nvfp4_grouped_linear(xp, _shape_only(w13, x), counts, recipe, weight_q=w13, backend=backend)
    gate, up = torch.chunk(hidden, 2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()) * up.float() * perm_probs.unsqueeze(-1)).to(hidden.dtype)
    out = nvfp4_grouped_linear(act, _shape_only(w2, x), counts, recipe, weight_q=w2, backend=backend)
    combined = torch.zeros(t, h, dtype=out.dtype, device=x.device)
    combined.scatter_add_(0, sorted_idx.unsqueeze(1).expand(-1, h), out)
    return combined


def _shape_only(ws, like: torch.Tensor) -> torch.Tensor:
    """A zero-storage [E, N, K] stand-in: nvfp4_grouped_linear reads only the weight's shape/dtype when weight_q
    is given."""
    n, k = ws[0].shape
    return like.new_zeros(()).expand(len(ws), n, k)
