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
    # HF Qwen3MoeForCausalLM vs the Megatron GPTModel (tests/unit/test_convert.py), same BF16 weights, CPU: the two
    # round every op's output to BF16 (8 significant bits, u = 2^-9) at different points (HF: RMSNorm in fp32 then
    # cast; router GEMM in BF16 vs Megatron's fp32 router; fused vs split QKV GEMMs; different attention kernels), so
    # each of the ~10 roundings per layer may differ by 1 BF16 ulp of its value. Through 4 layers and a vocab GEMM this
    # is a few BF16 ulps of the logit scale: atol = 2^-5 (4 ulps at 2^-9... times 2 for the residual sums) relative to
    # max|logit|; measured 0.0 - 0.6 of it. A top-k routing flip on a near-tie would exceed it and fail the test.
    "hf_vs_megatron_logits_bf16": (2.0 ** -5, 0.0),
    # --- learner (tests/unit/test_learner_*.py, tests/distributed/) ---
    # TP=2 / EP=2 vs the unsharded learner, fp32 compute: the sharded run sums the same fp32 products in another order
    # across ranks (row-parallel partial sums, the vocab-parallel log-softmax), a few fp32 ulps per op; measured
    # 5e-7 (log-probs, abs) and 6e-7 (per-parameter gradient, relative Frobenius). Bound 1e-5 for both.
    "learner_parallel_fp32": (1e-5, 1e-5),
    # NVFP4 gradients, sharded vs unsharded: the forward is exact up to fp32 order (amax synced over TP), but
    # stochastic rounding indexes its random stream by the element's position in the *local* tensor, so a sharded
    # run draws other rounding noise. The layout difference must not exceed rtol x the difference between two
    # unsharded runs with different rounding seeds (same distribution; measured ratio 0.76 - 0.96 over the worst
    # parameter; 2x covers the spread of a max over ~20 parameters).
    "learner_parallel_nvfp4_vs_seed_noise": (0.0, 2.0),
    # NVFP4 log-probs after one Adam step (lr 1e-3), sharded vs unsharded: Adam's first step is ~lr * sign(g), and
    # the rounding noise above flips the sign of small gradient entries; measured 0.025 - 0.028 abs.
    "learner_parallel_nvfp4_logp_after_step": (0.1, 0.0),
}
