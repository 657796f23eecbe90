"""Triton NVFP4 kernels (installed as minite.kernels), each beside its pure-PyTorch reference."""
