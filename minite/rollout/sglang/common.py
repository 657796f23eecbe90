"""The SGLang-free half of the minite_nvfp4 plugin: version pin, names, the ModelOpt NVFP4 layout as SGLang holds it,
the recipe <-> hf_quant_config.json mapping, and the MoE forward the plugin's fused-MoE method runs.

Imported by the plugin's SGLang classes (methods.py), strict mode (strict.py) and the engine (engine.py); it never
imports SGLang, so the version check can run before anything of SGLang's is touched. plugin.py's docstring has the
design.
"""
from __future__ import annotations

import importlib.metadata
import logging
import torch

from minite.ops import nvfp4_grouped_linear, routed_experts
from minite.nvfp4 import NVFP4Recipe

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
METHOD_NAME = "minite_nvfp4"


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


# --------------------------------------------------------------------------------------------------------------
# Recipe <-> quantization config
# --------------------------------------------------------------------------------------------------------------

def grouped_forward(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, recipe: NVFP4Recipe, backend: str = "auto", *,
                    strict: bool = False) -> torch.Tensor:
    """Routed NVFP4 SwiGLU experts on x [T, H] with top-k ids/weights [T, k], computed as the learner's MoE layer
    does (minite.ops.experts.routed_experts). w13 / w2: NVFP4Stack (`expert_stack`) or lists of per-expert
    NVFP4Tensors. strict: strict SiLU and the fixed-order combine (minite.ops.experts)."""
    weights = (w13, w2)

    def fc(a, i, counts):  # weight= is only read for its shape when weight_q is given (no quantisation happens)
        return nvfp4_grouped_linear(a, _shape_only(weights[i], x), counts, recipe, weight_q=weights[i],
                                    backend=backend)

    return routed_experts(x, topk_ids, topk_weights, len(w13), fc, strict=strict)


def _shape_only(ws, like: torch.Tensor) -> torch.Tensor:
    """A zero-storage [E, N, K] stand-in: nvfp4_grouped_linear reads only the weight's shape/dtype when weight_q
    is given."""
    n, k = ws[0].shape
    return like.new_zeros(()).expand(len(ws), n, k)
