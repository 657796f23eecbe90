"""Megatron-Core modules and specs: NVFP4 linears and experts, CPU support (installed as minite.megatron_patches)."""
