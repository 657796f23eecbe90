"""Every tolerance the test suite uses, in one table, each with the reason it is not zero.

Exact arithmetic is compared exactly (atol=0, rtol=0) and needs no entry here: quantisers, dequantisers, packing,
transposes, and kernels whose reduction order is defined.
"""
# Name: (atol, rtol). Scalars are relative to the quantity named in the comment.
FP32_EPS = 2.0 ** -23

TOLERANCES = {
    # RHT round trip x -> x M -> (x M) M^T in fp32: each output is a left-to-right fp32 sum of 16 terms of size
    # <= max|x|/4, so its error is <= 15 u * 4 max|x| (u = 2^-24); the inverse sums 16 of those errors at weight 1/4.
    # Bound: 16 * 15 * 2^-24 * max|x| < 2^-16 * max|x|. atol below is relative to max|x|.
    "rht_roundtrip": (2.0 ** -16, 0.0),
    # NVFP4 GEMM, fp32 sequential-K accumulation vs the float64 reference: the fp32 sum of K exact products has error
    # <= K * 2^-24 * sum_k |a_k b_k|; atol is relative to sum_k |a_k b_k| * |alpha| per output element, for K <= 4096.
    "nvfp4_gemm_fp32_acc": (4096 * 2.0 ** -24, 0.0),
    # The same GEMM on Hopper tensor cores (tests/gpu): the MMA adds a K-chunk of exact products after aligning them to
    # the largest exponent and truncating, so each accumulation step can lose up to 1 ulp (2^-23) instead of half.
    # Bound K * 2^-23 relative to sum_k |a_k b_k| * |alpha|, for K <= 4096.
    "nvfp4_gemm_tensorcore_acc": (4096 * 2.0 ** -23, 0.0),
}
