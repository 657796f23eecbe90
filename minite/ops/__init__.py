"""NVFP4 op functions, used by every engine: the learner's Megatron layers, the SGLang plugin, the export.

    linear.py    nvfp4_linear (autograd: fprop, dgrad, wgrad), nvfp4_linear_forward (also on packed weights as one
                 group: nvfp4_linear_forward_packed), quantize_weight
    grouped.py   nvfp4_grouped_linear (per-expert, autograd), its forward, quantize_expert_weights (and a dense
                 weight as a one-member packed stack, quantize_weight_packed); the experts' FC2 on their SwiGLU,
                 forward only (one fused launch before the GEMM on the kernels)
    experts.py   the MoE expert arithmetic written once: routing rows, SwiGLU experts, default/strict combine
    common.py    derived seeds, tensor-parallel amax groups, kernel-path flags, the device-side NaN/Inf flag,
                 16-row padding
    logprobs.py  default-mode token log-probs from the Gumbel sampler's log-sum-exp (rollout and learner alike)
They compute through `minite.nvfp4` (the format and its reference). Importing this package also imports the Triton
kernels (`minite.kernels`, which register themselves with minite.nvfp4.backend) when Triton is installed, so every
engine gets them behind backend="auto".
"""
try:  # Triton is an optional upstream: without it every op runs on the exact reference
    import minite.kernels  # noqa: F401
except ImportError:
    pass

from .common import (FiniteFlag, any_rank, collective_device, derive_seed, first_nonfinite, group_size,
                     quantiser_checks_finite, refill_in_place)
from .experts import (combine_fixed_order, combine_for_training, combine_scatter_add, grouped_linear_bf16, route,
                      routed_experts, swiglu, swiglu_experts)
from .grouped import (nvfp4_grouped_linear, nvfp4_grouped_linear_forward, nvfp4_swiglu_fc2_forward,
                      quantize_expert_weights, quantize_weight_packed)
from .linear import nvfp4_linear, nvfp4_linear_forward, nvfp4_linear_forward_packed, quantize_weight


__all__ = ["FiniteFlag", "first_nonfinite", "any_rank", "collective_device", "refill_in_place", "derive_seed",
           "group_size", "quantiser_checks_finite", "nvfp4_linear",
           "nvfp4_linear_forward", "quantize_weight", "nvfp4_grouped_linear", "nvfp4_grouped_linear_forward",
           "nvfp4_swiglu_fc2_forward", "nvfp4_linear_forward_packed", "quantize_weight_packed",
           "quantize_expert_weights", "swiglu", "swiglu_experts", "grouped_linear_bf16", "route", "routed_experts",
           "combine_scatter_add", "combine_for_training", "combine_fixed_order"]
