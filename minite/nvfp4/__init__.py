"""The NVFP4 format (E2M1 codes, E4M3 scales per 16 elements, an FP32 global scale), specified bit for bit.

Public API (docs/CONTRACTS.md): quantize, NVFP4Tensor, gemm, grouped_gemm, apply_rht, NVFP4Recipe, OperandRecipe;
for MoE experts quantize_stack / NVFP4Stack (weights) and quantize_column_segments / quantize_count_segments /
segmented_gemm / segmented_gemm_passes (wgrad).
The functions here are the reference every kernel is compared to bitwise; `backend=` selects Triton kernels.
"""
from .grouped import (NVFP4Segments, NVFP4Stack, decode_order, decode_scales, quantize_column_segments,
                      quantize_count_segments, quantize_stack, segmented_gemm, segmented_gemm_passes)
from .gemm import gemm, gemm_reference, grouped_gemm, grouped_gemm_reference, row_slice
from .hadamard import RHT_SIGNS, apply_rht, rht_matrix
from .quantize import NonFiniteError, quantize, quantize_reference, uniform_u24
from .recipe import NVFP4Recipe, OperandRecipe
from .tensor import BLOCK_1D, BLOCK_2D, E2M1_MAGNITUDES, NVFP4Tensor, e2m1_table, pack_codes, unpack_codes

__all__ = [
    "BLOCK_1D", "BLOCK_2D", "E2M1_MAGNITUDES", "NVFP4Recipe", "NVFP4Segments", "NVFP4Stack", "NVFP4Tensor",
    "NonFiniteError", "OperandRecipe", "RHT_SIGNS", "apply_rht", "decode_order", "decode_scales", "e2m1_table",
    "gemm", "gemm_reference", "grouped_gemm", "grouped_gemm_reference", "pack_codes", "quantize",
    "quantize_column_segments", "quantize_count_segments", "quantize_reference", "quantize_stack", "rht_matrix",
    "row_slice", "segmented_gemm", "segmented_gemm_passes", "uniform_u24", "unpack_codes",
]
