"""SGLang plugin: quantization method `minite_nvfp4`, computing with the learner's own NVFP4 op functions.

What it changes in SGLang (0.5.23 only; any other version raises `SGLangVersionError` at registration):
- registers `MiniteNVFP4Config` under the name "minite_nvfp4" in sglang.srt.layers.quantization's method tables
  (QUANTIZATION_METHODS first in order, see below; BASE_ and CPU_QUANTIZATION_METHODS) and as a CLI choice;
- appends "MiniteNVFP4LinearMethod" to sglang.srt.layers.linear.WEIGHT_LOADER_V2_SUPPORTED, so the linears load our
  parameters with the same (v2) loaders that ModelOpt's FP4 method uses;
- installs strict.py's dispatchers (idempotent): SGLang code runs unchanged except for a Qwen3-MoE model whose
  config.json says `"minite_strict": true` (written for cfg.alignment.strict), which then computes with the
  learner's strict ops (strict.py; with or without this quantization method);
- under SGLANG_FORCE_FUSED_OP_BACKEND=torch only: Qwen3-MoE's fused RoPE + KV-cache write off (`torch_rope_stores_kv`).
Why first in QUANTIZATION_METHODS: SGLang asks every method, in table order, whether to override the user's choice
for a checkpoint; ModelOpt's methods claim every ModelOpt NVFP4 checkpoint. Ours answers first and claims it only
when the user asked for "minite_nvfp4", so `--quantization minite_nvfp4` loads a ModelOpt export and every other
choice behaves as before. The table is reordered in place (the same dict object), idempotently.
How it is loaded: setup.py's entry point `minite_nvfp4 = minite.rollout.sglang.plugin:register` in SGLang's general
plugin group `sglang.srt.plugins`; SGLang calls it early in every process it starts (engine, scheduler, workers).

Weights are stored exactly as a ModelOpt NVFP4 checkpoint names them (minite.convert.export_nvfp4):
    weight        uint8 [N, K/2]       E2M1 codes, even element in the low nibble
    weight_scale  float8_e4m3fn [N, K/16]   one scale per 1x16 block
    weight_scale_2  fp32, one per logical shard (q/k/v, gate/up)   ModelOpt's decode scale fl(amax / 2688)
    weight_scale_amax  fp32, one per shard   the amax itself (minite's export; stock loaders skip the name)
    input_scale   fp32, one per shard   loaded for compatibility, ignored: see below
The learner quantises weights in 16x16 blocks; a 16x16 scale grid repeated over its 16 rows *is* a 1x16 grid with
the same values, so `minite.nvfp4.modelopt.weight_tensor(weight, weight_scale, weight_scale_2, amax=weight_scale_amax)` has exactly the
learner's block values and amax, and the GEMM (`minite.nvfp4.gemm`: exact block products, then TE's alpha
(amax_x * amax_w) * fl(1/(6*6*448*448))) gives the same bits. Why the amax travels as its own tensor: the GEMM alpha
needs the amax exactly and fl(amax / 2688) does not determine it (dividing by 21 * 2^7 maps some neighbouring fp32
amaxes to one value). A checkpoint without it (a foreign ModelOpt export) gets amax = fl(weight_scale_2 * 2688),
within an ulp or so of its producer's amax (docs/nvfp4.md, docs/sglang.md).

Activations are quantised as the recipe says: 1x16 blocks with one global scale per row (token), computed on the fly
by `minite.ops.nvfp4_linear_forward` (the forward the learner's nvfp4_linear runs). A token's quantisation
then depends on that token only, so rollout batches and training batches agree (docs/nvfp4.md, batch invariance). The
checkpoint's static `input_scale` is therefore not used by this plugin.

Experts: `MiniteNVFP4MoEMethod.apply` routes like Megatron's MoE layer does on the learner (tokens sorted by expert,
stable in token order; `nvfp4_grouped_linear` for fc1 and fc2; silu(gate) * up * router prob in fp32; the combine
adds each token's expert outputs in ascending expert order with scatter_add, as Megatron's unpermute does).
Backend: minite.nvfp4's "auto" (Triton on CUDA tensors, the exact reference on CPU), as the learner uses.
"""
from __future__ import annotations

import logging
import os

from .common import METHOD_NAME, SGLANG_VERSION, check_sglang_version

log = logging.getLogger(__name__)

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
    from . import strict  # imports SGLang: only after the version check

    strict.install()
    torch_rope_stores_kv()
    _REGISTERED = True
    log.info("minite_nvfp4: registered quantization method with sglang %s (linear + fused MoE)", SGLANG_VERSION)


def torch_rope_stores_kv() -> bool:
    """Under SGLANG_FORCE_FUSED_OP_BACKEND=torch (a GPU without sgl_kernel: SGLang's fused ops take their PyTorch
    bodies) SGLang's Qwen3-MoE still asks its RoPE to write the KV cache as well, on CUDA with a bf16 KV pool
    (`sglang.srt.models.utils.enable_fused_set_kv_buffer`), and the PyTorch RoPE refuses: `AssertionError:
    fused_set_kv_buffer_arg is not supported for native implementation` (the second H200 probe, docs/sglang.md).
    Then the model's module-level name answers False, for both of its uses (the RoPE call and the attention's
    save_kv_cache), so the attention layer stores K and V itself. Returns whether it switched. Not yet run on the
    GPU: the next probe shows whether the engine then generates."""
    if os.environ.get("SGLANG_FORCE_FUSED_OP_BACKEND") != "torch":
        return False
    import sglang.srt.models.qwen3_moe as qwen3_moe

    qwen3_moe.enable_fused_set_kv_buffer = _no_fused_kv_write
    return True


def _no_fused_kv_write(forward_batch) -> bool:
    return False


def _config_class():
    """MiniteNVFP4Config, defined on first use so that importing this module never imports SGLang."""
    global _CONFIG_CLS
    if _CONFIG_CLS is None:
        from . import methods  # imports SGLang: only once SGLang asks for the method
        _CONFIG_CLS = methods.build_config_class()
    return _CONFIG_CLS


_CONFIG_CLS = None
