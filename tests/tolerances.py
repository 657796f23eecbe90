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
    # HF Qwen3MoeForCausalLM vs the learner's Megatron GPTModel on the same converted weights (tests/unit/test_convert.py).
    # FP32: same math, different summation orders and op fusion (fused QKV GEMM, fp32 router either way); fp32 rounding
    # (u = 2^-24) through 4 layers of width 64 stays far below 2^-16 of max|logit| (measured 4.1e-7 - 4.6e-7). atol is
    # relative to max|logit|. A wrong name map, QKV interleave or RoPE base gives O(1) gaps.
    "hf_vs_megatron_logits_fp32": (2.0 ** -16, 0.0),
    # BF16: each engine rounds its intermediates to BF16 (u = 2^-9) at different points (HF: RMSNorm in fp32 then
    # cast, BF16 router GEMM, separate q/k/v GEMMs; Megatron: fp32 router, fused QKV), so neither is "the" answer.
    # The yardstick is the BF16 noise of the reference itself: e_hf = |HF_bf16 - HF_fp32| on the same weights. The gap
    # |MG_bf16 - HF_bf16| may be at most this factor times e_hf, on the max and on the mean over all logits
    # (measured on two weight draws: 0.87x, 1.09x on the max; 0.85x, 0.58x on the mean). A mapping error is >> e_hf.
    "hf_vs_megatron_logits_bf16_vs_noise": (2.0, 0.0),
    # The learner's NVFP4 ops and grouped GEMMs on the Triton kernels vs the reference backend, K <= 64 at
    # the test shapes (tests/kernels/test_learner_ops_kernels.py): the quantised operands are bitwise equal, so only
    # fp32 vs exact summation differs, <= K * 2^-24 * sum_k |a_k b_k| per element; sum_k |a_k b_k| stays within ~10x
    # of max |output| for these Gaussian operands, so the error is < 64 * 6e-8 * 10 ~ 4e-5 of max |output|. rtol is
    # relative to max |reference output|; a wrong scale, seed, padding or transpose gives O(1).
    "nvfp4_op_kernels_vs_reference": (0.0, 1e-4),
    # torch SDPA vs Megatron's unfused attention, fp32, 9 keys, head dim 16 (tests/unit/test_learner_layers.py):
    # the same softmax(QK^T * scale) V with other summation orders and a fused softmax; outputs are convex
    # combinations of values of size ~1, so the gap is a few fp32 ulps of 1. A wrong mask, scale or GQA mapping is O(0.1).
    "sdpa_vs_unfused_fp32": (1e-5, 0.0),
    # --- GPU paths of the learner (tests/gpu/test_learner_gpu.py) ---
    # BF16 experts on torch._grouped_mm vs a loop of per-expert matmuls (forward, dgrad, wgrad): both accumulate in
    # fp32 and round once to bf16, in other orders, so an element differs by at most ~1 bf16 ulp (2^-8 relative)
    # plus fp32 noise; normwise (relative Frobenius) that is < 2^-8. Bound 2^-7; a wrong expert offset is O(1).
    "bf16_grouped_mm_vs_loop": (0.0, 2.0 ** -7),
    # torch SDPA (flash) vs Megatron's unfused attention in bf16, causal, 1024 keys: the unfused path rounds the
    # fp32 softmax probabilities to bf16 (2^-9 relative) before P V and rounds scores to bf16; flash keeps them in
    # fp32. Each output sum_j p_j v_j then moves by <= ~2^-9 * max|v| per rounding, a few of them; atol below is
    # relative to max|v|. A wrong mask or scale moves outputs by O(max|v|).
    "sdpa_vs_unfused_bf16": (2.0 ** -6, 0.0),
    # A 2-layer NVFP4 learner step on the kernels vs the reference backend (same seeds, bitwise-equal quantisers):
    # fp32 vs exact sums change a GEMM output by ~1e-6 relative, but a later quantisation can round such an element
    # to the other neighbour (one E2M1 step, up to 1/3 relative for that element), so loss and gradient norm differ
    # by a few such flips averaged over ~1e5 elements. Bound 2% relative; a wrong scale/seed/transpose is O(1).
    "nvfp4_learner_kernels_vs_reference": (0.0, 0.02),
    # NVFP4 quantisation error itself, relative Frobenius, Gaussian data (tests/unit/test_nvfp4_te_reference.py, the
    # saturated-S_enc case): rounding to E2M1 costs up to half a grid step, 1/6 of a block's amax at the top, and the
    # E4M3 block scale up to 1/16 more; measured 0.096-0.099 for normal and saturated-scale tensors and 0.093 for a
    # GEMM with one such operand. Bound 0.2; a decode factor off by the unsaturated amax is off by > 1e30.
    "nvfp4_quantisation_rel_error": (0.0, 0.2),
    # --- learner (tests/unit/test_learner_*.py, tests/distributed/) ---
    # TP=2 / EP=2 vs the unsharded learner, fp32 compute: the sharded run sums the same fp32 products in another order
    # across ranks (row-parallel partial sums, the vocab-parallel log-softmax), a few fp32 ulps per op; measured
    # 5e-7 (log-probs, abs) and 6e-7 (per-parameter gradient, relative Frobenius). Bound 1e-5 for both.
    "learner_parallel_fp32": (1e-5, 1e-5),
    # Weights after 3 GRPO steps (Adam, lr 1e-3) of the learner with the batch's rows split over DP=2 (and EP=2) vs
    # the single-process run, fp32 compute (tests/distributed/test_data_parallel.py): the gradients differ only by
    # the order of fp32 sums (DDP's cross-rank sum, the all-to-all'd expert tokens), a few ulps; Adam's update
    # lr * m / (sqrt(v) + eps) passes a relative gradient error through at about its size (more only where |g| is
    # near eps), so the weights move apart by ~lr * 1e-6 per step; measured 2.1e-7 (DP=2) and 4.3e-7 (EP=2) abs.
    # Bound 1e-5 abs = 1% of one Adam step: a missed row or a per-rank token mean changes a step by O(lr) (a uniform
    # gradient scale, which Adam hides, shows in the grad norm, checked with learner_parallel_fp32).
    "learner_data_parallel_weights": (1e-5, 0.0),
    # NVFP4 gradients, sharded vs unsharded: the forward is exact up to fp32 order (amax synced over TP), but
    # stochastic rounding indexes its random stream by the element's position in the *local* tensor, so a sharded
    # run draws other rounding noise. The layout difference must not exceed rtol x the difference between two
    # unsharded runs with different rounding seeds (same distribution; measured ratio 0.76 - 0.96 over the worst
    # parameter; 2x covers the spread of a max over ~20 parameters).
    "learner_parallel_nvfp4_vs_seed_noise": (0.0, 2.0),
    # NVFP4 log-probs after one Adam step (lr 1e-3), sharded vs unsharded: Adam's first step is ~lr * sign(g), and
    # the rounding noise above flips the sign of small gradient entries; measured 0.025 - 0.028 abs.
    "learner_parallel_nvfp4_logp_after_step": (0.1, 0.0),
    # One NVFP4 W4A4 linear (fprop, dgrad, wgrad) vs the fp32 product, Gaussian operands: each quantised operand
    # carries a relative RMS error of ~0.1 (E2M1 has 8 magnitudes: with a block's max at 6 a typical element at 1-3
    # has a step of 0.5-1; stochastic rounding adds variance), so a product of two has ~0.14; measured 0.145 - 0.17
    # (relative Frobenius). Bound 0.25: catches a wrong scale, a missing transpose or a dropped block.
    "nvfp4_linear_vs_fp32": (0.0, 0.25),
    # The tiny Qwen3-MoE (2 layers) built NVFP4 vs BF16 with the same weights: logits relative Frobenius error,
    # measured 0.104 - 0.106 (the per-GEMM error above, partly averaged by the residual stream). Bound 0.25.
    "nvfp4_model_vs_bf16_logits": (0.0, 0.25),
    # Same models, all gradients concatenated (relative Frobenius): measured 0.22 (router and q/k-norm gradients,
    # which go through softmaxes, are the noisiest, up to 0.65 alone). Bound 0.5 ~ cosine similarity > 0.87.
    "nvfp4_model_vs_bf16_grads": (0.0, 0.5),
}
