"""miniTE: reinforcement learning of LLMs in native NVFP4 (W4A4).

Folders, one role each: nvfp4 (the format, exact reference), learner (Megatron-Core),
rollout (engines), rl (the loop), alignment (strict mode and diagnostics);
minite.kernels (Triton) and minite.megatron_patches (upstream modules and specs).
"""
__version__ = "0.1.0"
