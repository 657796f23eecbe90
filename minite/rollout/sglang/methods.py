"""The SGLang classes of the minite_nvfp4 plugin (imported only once SGLang is; see plugin.py for the design).

- MiniteNVFP4Config     QuantizationConfig: names the method, reads hf_quant_config.json, picks a method per layer.
- MiniteNVFP4LinearMethod  LinearMethodBase for QKVParallelLinear, RowParallelLinear (o_proj), dense MLP linears:
                        ModelOpt-layout parameters, apply() = minite.ops.nvfp4_linear_forward.
- MiniteNVFP4MoEMethod  FusedMoEMethodBase for FusedMoE: ModelOpt-layout expert parameters (w13_*, w2_*),
                        apply() = common.grouped_forward (the learner's grouped op functions).
Parameters keep the checkpoint layout after loading (process_weights_after_loading repacks nothing), so weight
updates can reload them any number of times. process_weights_after_loading (at load, and again after every weight
update: engine.end_weight_update) prepares each layer's NVFP4 view of them once (`layer.minite_weight`,
`layer.minite_experts`): codes and scales as views of the parameters, the global scales derived from weight_scale_2
and the amax, where deciding whether a fused weight's shards share one scale reads the device. apply() only reads
the prepared view, so it has no host synchronisation and SGLang can capture it in its decode CUDA graphs (the second
H200 probe's capture failed on that read, made per call); after an update the view is refreshed in place
(`minite.ops.refill_in_place`: the addresses the graphs captured keep pointing at the new values).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
)
from sglang.srt.utils import set_weight_attrs

from minite.nvfp4 import NVFP4Recipe
from minite.nvfp4.modelopt import GROUP, expert_stack, recipe_from_json, weight_tensor
from minite.ops import nvfp4_linear_forward, refill_in_place

from .common import METHOD_NAME, grouped_forward


def _prepare(layer: torch.nn.Module, attr: str, view):
    """Set layer.<attr> to `view`, in place where one of the same layout exists (module docstring); returns it."""
    old = getattr(layer, attr, None)
    if old is not None and refill_in_place(old, view):
        return old
    if old is not None and any(p.is_cuda for p in layer.parameters()):  # SGLang's decode graphs replay the old view
        raise ValueError(f"minite_nvfp4: a weight update changed whether the shards of a fused weight in "
                         f"{type(layer).__name__} share one global scale; the engine's CUDA graphs hold the old "
                         "layout: start the engine again with these weights")
    setattr(layer, attr, view)
    return view



def _scale_param(shape, weight_loader, fill: Optional[float] = None) -> PerTensorScaleParameter:
    data = torch.empty(shape, dtype=torch.float32) if fill is None else torch.full(shape, fill, dtype=torch.float32)
    p = PerTensorScaleParameter(data=data, weight_loader=weight_loader)
    set_weight_attrs(p, {"needs_scalar_to_array": True})
    return p


class MiniteNVFP4LinearMethod(LinearMethodBase):
    """NVFP4 W4A4 linear with per-row activation scales (the learner's fprop)."""

    def __init__(self, config: "MiniteNVFP4Config"):
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if input_size_per_partition % GROUP:
            raise ValueError(f"minite_nvfp4: input size {input_size_per_partition} is not a multiple of {GROUP}")
        n, k = sum(output_partition_sizes), input_size_per_partition
        loader = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = list(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=torch.empty(n, k // GROUP, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
            weight_loader=loader))
        shards = (len(output_partition_sizes),)
        layer.register_parameter("weight_scale_2", _scale_param(shards, loader))
        # the amax per shard (sglang_plugin docstring); NaN until loaded, so a checkpoint without it is detectable
        layer.register_parameter("weight_scale_amax", _scale_param(shards, loader, fill=float("nan")))
        layer.register_parameter("input_scale", _scale_param(shards, loader, fill=1.0))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name, dtype in (("weight", torch.uint8), ("weight_scale", torch.float8_e4m3fn),
                            ("weight_scale_2", torch.float32)):
            t = getattr(layer, name)
            if t.dtype != dtype:
                raise ValueError(f"minite_nvfp4: {name} has dtype {t.dtype}, expected {dtype}")
        self.prepare(layer)

    @staticmethod
    def prepare(layer: torch.nn.Module):
        """The layer's NVFP4 weight view (module docstring), made or refreshed now."""
        return _prepare(layer, "minite_weight", weight_tensor(layer.weight.data, layer.weight_scale.data,
                                                              layer.weight_scale_2.data, layer.logical_widths,
                                                              layer.weight_scale_amax.data))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = getattr(layer, "minite_weight", None)
        if w is None:  # used before process_weights_after_loading (a layer built by hand)
            w = self.prepare(layer)
        y = nvfp4_linear_forward(x, w, self.config.recipe, backend=self.config.backend)
        return y + bias if bias is not None else y


class MiniteNVFP4MoEMethod(FusedMoEMethodBase):
    """NVFP4 W4A4 routed experts (SwiGLU), computed as the learner's GroupedExperts."""

    def __init__(self, config: "MiniteNVFP4Config"):
        super().__init__()
        self.config = config
        self.moe_runner_config = None

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported

        if extra_weight_attrs.pop("with_bias", False):
            raise ValueError("minite_nvfp4: expert biases are not supported")
        if hidden_size % GROUP or intermediate_size_per_partition % GROUP:
            raise ValueError(f"minite_nvfp4: hidden {hidden_size} and expert ffn {intermediate_size_per_partition} "
                             f"must be multiples of {GROUP}")
        e, h, f = layer.num_local_experts, hidden_size, intermediate_size_per_partition
        layer.intermediate_size_per_partition = f
        block = dict(extra_weight_attrs, quant_method=FusedMoeWeightScaleSupported.BLOCK.value)
        tensor = dict(extra_weight_attrs, quant_method=FusedMoeWeightScaleSupported.TENSOR.value)
        params = {
            "w13_weight": (torch.empty(e, 2 * f, h // 2, dtype=torch.uint8), block),
            "w2_weight": (torch.empty(e, h, f // 2, dtype=torch.uint8), block),
            "w13_weight_scale": (torch.empty(e, 2 * f, h // GROUP, dtype=torch.float8_e4m3fn), block),
            "w2_weight_scale": (torch.empty(e, h, f // GROUP, dtype=torch.float8_e4m3fn), block),
            "w13_weight_scale_2": (torch.empty(e, 2, dtype=torch.float32), tensor),
            "w2_weight_scale_2": (torch.empty(e, dtype=torch.float32), tensor),
            # the amaxes (sglang_plugin docstring), NaN until loaded
            "w13_weight_scale_amax": (torch.full((e, 2), float("nan")), tensor),
            "w2_weight_scale_amax": (torch.full((e,), float("nan")), tensor),
            # ModelOpt's static activation scales, loaded and ignored (per-row scales are computed per token)
            "w13_input_scale": (torch.ones(e, dtype=torch.float32), tensor),
            "w2_input_scale": (torch.ones(e, dtype=torch.float32), tensor),
        }
        for name, (data, attrs) in params.items():
            p = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, attrs)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        activation = getattr(moe_runner_config, "activation", "silu")
        if activation != "silu" or not getattr(moe_runner_config, "is_gated", True):
            raise ValueError(f"minite_nvfp4: only gated SiLU (SwiGLU) experts are supported, got {activation!r}")
        if getattr(moe_runner_config, "apply_router_weight_on_input", False):
            raise ValueError("minite_nvfp4: apply_router_weight_on_input is not supported")
        self.moe_runner_config = moe_runner_config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.prepare(layer)

    def prepare(self, layer: torch.nn.Module):
        """The layer's (w13, w2) view (module docstring), made or refreshed now."""
        return _prepare(layer, "minite_experts", self.experts(layer))

    def experts(self, layer: torch.nn.Module):
        """(w13, w2): NVFP4Stacks over the loaded parameters (no copy of codes or scales), made now."""
        return (expert_stack(layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data,
                             layer.w13_weight_scale_amax.data),
                expert_stack(layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data,
                             layer.w2_weight_scale_amax.data))

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[0], dispatch_output.topk_output[1]
        prepared = getattr(layer, "minite_experts", None)
        if prepared is None:  # used before process_weights_after_loading (a layer built by hand)
            prepared = self.prepare(layer)
        w13, w2 = prepared
        out = grouped_forward(x, w13, w2, topk_weights, topk_ids, self.config.recipe, backend=self.config.backend)
        scale = getattr(self.moe_runner_config, "routed_scaling_factor", None)
        if scale not in (None, 1.0):
            out = out * scale
        return StandardCombineInput(hidden_states=out)


class MiniteNVFP4Config(QuantizationConfig):
    """Quantization method "minite_nvfp4" over a ModelOpt NVFP4 checkpoint (hf_quant_config.json)."""

    def __init__(self, recipe: Optional[NVFP4Recipe] = None, exclude_modules: Optional[List[str]] = None,
                 backend: str = "auto"):
        super().__init__()
        self.recipe = recipe or NVFP4Recipe()
        self.exclude_modules = list(exclude_modules or [])
        self.backend = backend

    @classmethod
    def get_name(cls) -> str:
        return METHOD_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> List[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # any device: the reference runs on CPU, the Triton kernels on any CUDA GPU Triton supports

    @classmethod
    def get_config_filenames(cls) -> List[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "MiniteNVFP4Config":
        quant = config.get("quantization", config)
        algo = str(quant.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise ValueError(f"minite_nvfp4 loads ModelOpt NVFP4 checkpoints (quant_algo NVFP4), got {algo!r}; "
                             "write one with `minite convert export-nvfp4`")
        if int(quant.get("group_size", GROUP)) != GROUP:
            raise ValueError(f"minite_nvfp4: group_size must be {GROUP}, got {quant.get('group_size')}")
        exclude = quant.get("exclude_modules") or quant.get("ignore") or []
        return cls(recipe_from_json(config.get("minite")), exclude)

    @classmethod
    def override_quantization_method(cls, hf_quant_config, user_quant) -> Optional[str]:
        """Claim an NVFP4 checkpoint when the user asked for minite_nvfp4 (plugin.py's docstring says why)."""
        if user_quant != METHOD_NAME or hf_quant_config is None:
            return None
        algo = str(hf_quant_config.get("quant_algo", "")).upper()
        method = str(hf_quant_config.get("quant_method", ""))
        return METHOD_NAME if algo == "NVFP4" or method in ("modelopt_fp4", METHOD_NAME) else None

    def _excluded(self, prefix: str) -> bool:
        for pat in self.exclude_modules:
            if pat.endswith("*") and prefix.startswith(pat[:-1]):
                return True
            if prefix == pat or prefix.startswith(pat + ".") or prefix.endswith("." + pat):
                return True
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if self._excluded(prefix) else MiniteNVFP4LinearMethod(self)
        if isinstance(layer, FusedMoE):
            if self._excluded(prefix):
                raise ValueError(f"minite_nvfp4: BF16 experts ({prefix}) are not supported")
            return MiniteNVFP4MoEMethod(self)
        return None

    def get_scaled_act_names(self) -> List[str]:
        return []


def build_config_class():
    return MiniteNVFP4Config
