"""Checkpoint conversion: Hugging Face <-> Megatron-Core (hf_megatron), NVFP4 export for SGLang (export_nvfp4)."""
