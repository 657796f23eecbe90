"""Triton NVFP4 kernels (installed as minite.kernels), each bitwise equal to its pure-PyTorch reference in
minite.nvfp4 (docs/nvfp4.md).

nvfp4_quant.py   fused quantisation (1x16 / 16x16 blocks, tensor / row scale, RNE / stochastic, RHT), bitwise = reference
nvfp4_encode.py  the element encodings the quantisers share: E4M3 and E2M1 roundings, E2M1 pairs in PTX on a GPU
nvfp4_segments.py  the same quantisation of many segments of one tensor in one launch (expert stacks, MoE wgrad)
nvfp4_values.py  fp16 block values from packed 1x16-block codes (the MoE wgrad operand kept packed until its GEMM)
nvfp4_decode_order.py  packed codes rewritten in the decode order of the small-M GEMMs (rollout expert weights)
nvfp4_gemm.py    W4A4 GEMMs: dense, MoE grouped over tokens (fprop, dgrad), small-M decode tiles; the operand decoding
nvfp4_wgrad.py   the MoE wgrad: grouped over K (tokens), into main_grad, several micro-batches in one launch
nvfp4_swiglu.py  SwiGLU with its NVFP4 output quantisation fused in, and its backward; the experts' SwiGLU (the
                 model's arithmetic) fused with FC2's activation quantisation, forward only
expert_swiglu.py the experts' SwiGLU (the model's arithmetic, router prob included), forward and backward, for training
finite_max.py    the NaN/Inf flag of the NVFP4 layers (minite.ops.FiniteFlag) in one launch, where no quantiser takes it
copy_amax.py     the optimizer's fp32 master -> bf16 copy of expert weights with each expert's amax (re-quantisation)
moe_rows.py      the MoE dispatch's rows, probs and counts from a routing map; the router's dense outputs (rollouts)
megatron_rope.py Megatron-Core's unfused RoPE in one launch, for CUDA inference (megatron_patches.rope)
gumbel_sample.py the rollout's Gumbel-max token sampler, two launches (minite.rollout.sampling: its definition)
_interpreter.py  a fix that lets triton 3.6's CPU interpreter run kernels with runtime loop bounds under numpy >= 2.4
_launch.py       the launchers' host side: compiled kernels launched without Triton's per-launch Python, grid integers

The folder is the top-level kernels/ of the repository, installed under the minite namespace (setup.py's
package_dir): a global module named `kernels` would collide with Hugging Face's `kernels` package.
Importing it needs Triton and registers the entry points with minite.nvfp4.backend, which the format's functions
(quantize, gemm, grouped_gemm, quantize_stack, ...) dispatch to for backend "triton" / "auto" on CUDA tensors.
"""
from minite.nvfp4.backend import register_kernels

from .copy_amax import copy_amax_triton
from .expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton
from .finite_max import finite_max_into
from .nvfp4_decode_order import decode_order_triton
from .nvfp4_gemm import gemm_triton, grouped_gemm_triton
from .nvfp4_quant import amax_triton, quantize_with_values_triton
from .nvfp4_segments import quantize_count_segments_triton, quantize_segments_triton
from .nvfp4_swiglu import expert_swiglu_quantize_triton
from .nvfp4_values import block_values_triton
from .nvfp4_wgrad import segmented_gemm_passes_triton, segmented_gemm_triton

register_kernels(quantize_with_values=quantize_with_values_triton, quantize_segments=quantize_segments_triton,
                 quantize_count_segments=quantize_count_segments_triton,
                 gemm=gemm_triton, grouped_gemm=grouped_gemm_triton, segmented_gemm=segmented_gemm_triton,
                 segmented_gemm_passes=segmented_gemm_passes_triton,
                 finite_max=finite_max_into, block_values=block_values_triton,
                 expert_swiglu_quantize=expert_swiglu_quantize_triton, decode_order=decode_order_triton,
                 copy_amax=copy_amax_triton, expert_swiglu=expert_swiglu_triton,
                 expert_swiglu_backward=expert_swiglu_backward_triton, amax=amax_triton)
