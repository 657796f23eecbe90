"""The SGLang rollout backend and every patch miniTE makes to SGLang 0.5.23 (docs/sglang.md).

engine.py   SGLangEngine behind minite.rollout.base.RolloutEngine: offline engine, log-probs, NVFP4 weight sync
plugin.py   the `sglang.srt.plugins` entry point: registers quantization method "minite_nvfp4" (version-pinned)
methods.py  the plugin's SGLang classes: linear and fused-MoE methods computing with minite.ops
strict.py   strict mode inside SGLang: its Qwen3-MoE forward with minite.strict's batch-invariant ops
common.py   the SGLang-free part: version pin, names, ModelOpt layout as SGLang holds it, the MoE forward
"""
