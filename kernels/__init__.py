"""Triton NVFP4 kernels (installed as minite.kernels), each beside its pure-PyTorch reference in minite.nvfp4.

nvfp4_quant.py   fused quantisation (1x16 / 16x16 blocks, tensor / row scale, RNE / stochastic, RHT), bitwise = reference
nvfp4_gemm.py    W4A4 GEMMs: dense, MoE grouped over tokens (fprop, dgrad), grouped over K (wgrad), small-M decode tiles
nvfp4_swiglu.py  SwiGLU with its NVFP4 output quantisation fused in, and its backward
_interpreter.py  a fix that lets triton 3.6's CPU interpreter run kernels with runtime loop bounds under numpy >= 2.4
"""
