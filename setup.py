"""miniTE: reinforcement learning of LLMs in native NVFP4 (W4A4).

The top-level folders kernels/ and megatron_patches/ install as minite.kernels
and minite.megatron_patches: a global module named `kernels` would collide with
an existing PyPI package that transformers can import.
"""
from setuptools import setup

PACKAGES = {
    "minite": "minite",
    "minite.nvfp4": "minite/nvfp4",
    "minite.learner": "minite/learner",
    "minite.ops": "minite/ops",
    "minite.strict": "minite/strict",
    "minite.models": "minite/models",
    "minite.rollout": "minite/rollout",
    "minite.rollout.sglang": "minite/rollout/sglang",
    "minite.rl": "minite/rl",
    "minite.rl.tasks": "minite/rl/tasks",
    "minite.alignment": "minite/alignment",
    "minite.convert": "minite/convert",
    "minite.kernels": "kernels",
    "minite.megatron_patches": "megatron_patches",
}

setup(
    name="minite",
    version="0.1.0",
    description="Reinforcement learning of LLMs in native NVFP4: Megatron-Core learner, SGLang rollout, one set of kernels",
    python_requires=">=3.11,<3.13",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    install_requires=["torch>=2.11", "numpy", "pyyaml", "tqdm", "safetensors"],
    extras_require={
        # Upstreams we patch are pinned exactly: our patches name their classes.
        "megatron": ["megatron-core==0.16.1"],
        "triton": ["triton>=3.6"],
        "tensorboard": ["tensorboard"],
        # transformers 5.25 requires Hugging Face's `kernels` package and imports it by that top-level name, which
        # this repository's kernels/ folder shadows wherever the checkout's root is on sys.path (`python3 -m pytest`
        # from the root): its hub-kernels integration then fails to import (seen 2026-12-04 in a fresh setup).
        "transformers": ["transformers<5.25"],
        # sglang==0.5.23 is installed with --no-deps (its CUDA-only pins); see README.
        "dev": ["pytest", "hypothesis", "import-linter==2.17"],
    },
    entry_points={
        "console_scripts": ["minite=minite.cli:main"],
        # SGLang runs every entry point of this group in each of its processes (minite/rollout/sglang/plugin.py).
        "sglang.srt.plugins": ["minite_nvfp4=minite.rollout.sglang.plugin:register"],
    },
)
