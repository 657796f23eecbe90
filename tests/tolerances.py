"""Every tolerance the test suite uses, in one table, each with the reason it is not zero.

Exact arithmetic is compared exactly (atol=0, rtol=0) and needs no entry here: quantisers, dequantisers, packing,
transposes, and kernels whose reduction order is defined.
"""
# Name: (atol, rtol). Scalars are relative to the quantity named in the comment.
# Where an entry quotes a measurement "over N seeds": this project's 2-core CPU machine (torch 2.13 CPU), 2026-11-30,
# commit 0adbff5, running the test's own computation (same shapes, distributions, dtypes) under torch.manual_seed(s)
# for s in range(N); the smallest and largest error over the seeds are quoted.
FP32_EPS = 2.0 ** -23

TOLERANCES = {
    # RHT round trip x -> x M -> (x M) M^T in fp32: each output is a left-to-right fp32 sum of 16 terms of size
    # <= max|x|/4, so its error is <= 15 u * 4 max|x| (u = 2^-24); the inverse sums 16 of those errors at weight 1/4.
    # Bound: 16 * 15 * 2^-24 * max|x| < 2^-16 * max|x|. atol below is relative to max|x|.
    "rht_roundtrip": (2.0 ** -16, 0.0),
    # NVFP4 GEMM, fp32 sequential-K accumulation vs the float64 reference: the fp32 sum of K exact products has error
    # <= K * 2^-24 * sum_k |a_k b_k|; atol is relative to sum_k |a_k b_k| * |alpha| per output element, for K <= 4096.
    "nvfp4_gemm_fp32_acc": (4096 * 2.0 ** -24, 0.0),
    # The same GEMM on Hopper tensor cores (the GPU tests, marker gpu): the MMA adds a K-chunk of exact products after aligning them to
    # the largest exponent and truncating, so each accumulation step can lose up to 1 ulp (2^-23) instead of half.
    # Bound K * 2^-23 relative to sum_k |a_k b_k| * |alpha|, for K <= 4096.
    "nvfp4_gemm_tensorcore_acc": (4096 * 2.0 ** -23, 0.0),
    # HF Qwen3MoeForCausalLM vs the learner's Megatron GPTModel on the same converted weights (tests/convert/test_convert.py).
    # FP32: same math, different summation orders and op fusion (fused QKV GEMM, fp32 router either way); fp32 rounding
    # (u = 2^-24) through 4 layers of width 64 stays far below 2^-16 of max|logit| (measured 4.1e-7 - 4.6e-7). atol is
    # relative to max|logit|. A wrong name map, QKV interleave or RoPE base gives O(1) gaps.
    "hf_vs_megatron_logits_fp32": (2.0 ** -16, 0.0),
    # BF16: each engine rounds its intermediates to BF16 (u = 2^-8) at different points (HF: RMSNorm in fp32 then
    # cast, BF16 router GEMM, separate q/k/v GEMMs; Megatron: fp32 router, fused QKV), so neither is "the" answer.
    # The yardstick is the BF16 noise of the reference itself: e_hf = |HF_bf16 - HF_fp32| on the same weights. The gap
    # |MG_bf16 - HF_bf16| may be at most this factor times e_hf, on the max and on the mean over all logits
    # (measured on two weight draws: 0.87x, 1.09x on the max; 0.85x, 0.58x on the mean). A mapping error is >> e_hf.
    "hf_vs_megatron_logits_bf16_vs_noise": (2.0, 0.0),
    # The learner's NVFP4 ops and grouped GEMMs on the Triton kernels vs the reference backend, K <= 64 at
    # the test shapes (tests/ops/test_ops_kernels.py): the quantised operands are bitwise equal, so only
    # fp32 vs exact summation differs, <= K * 2^-24 * sum_k |a_k b_k| per element; sum_k |a_k b_k| stays within ~10x
    # of max |output| for these Gaussian operands, so the error is < 64 * 6e-8 * 10 ~ 4e-5 of max |output|. rtol is
    # relative to max |reference output|; a wrong scale, seed, padding or transpose gives O(1).
    "nvfp4_op_kernels_vs_reference": (0.0, 1e-4),
    # torch SDPA vs Megatron's unfused attention, fp32, 9 keys, head dim 16 (tests/megatron_patches/test_layers.py):
    # the same softmax(QK^T * scale) V with other summation orders and a fused softmax; outputs are convex
    # combinations of values of size ~1, so the gap is a few fp32 ulps of 1. A wrong mask, scale or GQA mapping is O(0.1).
    "sdpa_vs_unfused_fp32": (1e-5, 0.0),
    # --- GPU paths of the learner (tests/learner/test_learner_gpu.py) ---
    # BF16 experts on torch._grouped_mm vs a loop of per-expert matmuls (forward, dgrad, wgrad): both accumulate in
    # fp32 and round once to bf16, in other orders, so an element differs by at most ~1 bf16 ulp (2^-8 relative)
    # plus fp32 noise; normwise (relative Frobenius) that is < 2^-8. Bound 2^-7; a wrong expert offset is O(1).
    "bf16_grouped_mm_vs_loop": (0.0, 2.0 ** -7),
    # torch SDPA (flash) vs Megatron's unfused attention in bf16, causal, 1024 keys: the unfused path rounds the
    # fp32 softmax probabilities to bf16 (2^-8 relative) before P V and rounds scores to bf16; flash keeps them in
    # fp32. Each output sum_j p_j v_j then moves by <= ~2^-8 * max|v| per rounding, a few of them; atol below is
    # relative to max|v|. A wrong mask or scale moves outputs by O(max|v|).
    "sdpa_vs_unfused_bf16": (2.0 ** -6, 0.0),
    # A 2-layer NVFP4 learner step on the kernels vs the reference backend (same seeds, bitwise-equal quantisers):
    # fp32 vs exact sums change a GEMM output by ~1e-6 relative, but a later quantisation can round such an element
    # to the other neighbour (one E2M1 step, up to 1/3 relative for that element), so loss and gradient norm differ
    # by a few such flips averaged over ~1e5 elements. Bound 2% relative; a wrong scale/seed/transpose is O(1).
    "nvfp4_learner_kernels_vs_reference": (0.0, 0.02),
    # NVFP4 quantisation error itself, relative Frobenius, Gaussian data (tests/nvfp4/test_te_reference.py, the
    # saturated-S_enc case): rounding to E2M1 costs up to half a grid step, 1/6 of a block's amax at the top, and the
    # E4M3 block scale up to 1/16 more; measured 0.096-0.099 for normal and saturated-scale tensors and 0.093 for a
    # GEMM with one such operand. Bound 0.2; a decode factor off by the unsaturated amax is off by > 1e30.
    "nvfp4_quantisation_rel_error": (0.0, 0.2),
    # --- learner (tests/learner/ and tests/megatron_patches/, the distributed tests) ---
    # TP=2 / EP=2 vs the unsharded learner, fp32 compute: the sharded run sums the same fp32 products in another order
    # across ranks (row-parallel partial sums, the vocab-parallel log-softmax), a few fp32 ulps per op; measured
    # 5e-7 (log-probs, abs) and 6e-7 (per-parameter gradient, relative Frobenius). Bound 1e-5 for both.
    "learner_parallel_fp32": (1e-5, 1e-5),
    # Weights after 3 GRPO steps (Adam, lr 1e-3) of the learner with the batch's rows split over DP=2 (and EP=2) vs
    # the single-process run, fp32 compute (tests/learner/test_data_parallel.py): the gradients differ only by
    # the order of fp32 sums (DDP's cross-rank sum, the all-to-all'd expert tokens), a few ulps; Adam's update
    # lr * m / (sqrt(v) + eps) passes a relative gradient error through at about its size (more only where |g| is
    # near eps), so the weights move apart by ~lr * 1e-6 per step; measured 2.1e-7 (DP=2) and 4.3e-7 (EP=2) abs.
    # Bound 1e-5 abs = 1% of one Adam step: a missed row or a per-rank token mean changes a step by O(lr) (a uniform
    # gradient scale, which Adam hides, shows in the grad norm, checked with learner_parallel_fp32).
    "learner_data_parallel_weights": (1e-5, 0.0),
    # Gradient accumulation vs the whole batch, fp32 compute (tests/learner/test_learner_state.py): the chunks'
    # gradients are summed in DDP's fp32 buffer instead of inside one backward, the same products in another order
    # (a few ulps); measured 6e-8 (loss), 0 (gradient norm) and 3.4e-7 (weights)
    # on the test's inputs (CPU, torch 2.13). rtol: loss and gradient norm, relative; atol: weights after one Adam step
    # (lr 3e-3), abs. Adam's first step is lr * g / (|g| + eps), so an entry whose |g| is near eps moves by up to
    # ~lr * (relative gradient error) * |g| / eps; a missed chunk or a chunk counted twice changes the step by O(lr).
    "learner_micro_batches_fp32": (1e-5, 1e-5),
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
    # --- NVFP4 format (tests/nvfp4/) ---
    # Floor of every bound relative to a magnitude (tests/kernels, the GPU tests, the dequantisation fuzz): below 2^-126
    # fp32 results are spaced 2^-149 apart, so one rounding of a subnormal result is off by up to 2^-150 ~ 7e-46 in
    # absolute terms however small the bound's magnitude; 1e-45 admits that one rounding and nothing more.
    "fp32_subnormal_floor": (1e-45, 0.0),
    # Dequantisation error of any input (hypothesis fuzz): at most half the largest E2M1 step (4 -> 6: 1.0) times the
    # block's unit scale x global scale; saturation costs <= 0.4 units (the E4M3 scale rounds by <= 1/16, so
    # |x * mult| <= 6.4). atol is in those units. The 2^-10 slack covers the fp32 roundings of the scale products and
    # of the dequantised value (a few 2^-24 relative), so it is looser than needed (2^-20 would do).
    "nvfp4_dequant_vs_scale_unit": (1.0 * (1 + 2.0 ** -10), 0.0),
    # quantize(dequantize(q)) recomputes the global scale from the dequantised amax, which is 6 * 448 * S_dec rounded
    # in fp32 instead of the original amax: each of the ~4 fp32 operations on the way (6 * 448 * S_dec, 2688 / amax,
    # the reciprocal) rounds by <= 1/2 ulp. atol in ulps of the fp32 global scale; measured 0 - 2 ulps over 300 seeds
    # x 3 block layouts of randn(32, 64).
    "requantised_global_scale_ulps": (4, 0.0),
    # gemm(a, b) (float64 sum of exact block products, rounded once, then x fp32 global scales) vs the float64 product
    # of the fp32-dequantised operands: dequantisation rounds each operand (u = 2^-24 each), gemm rounds its sum, the
    # product of the two global scales and the scaled result (3 u), the comparison rounds once more: the gap is
    # <= 6 u * sum_k |a_k b_k| (dequantised operands). atol is relative to that sum per output element; measured
    # <= 1.33 u over 2000 seeds (K = 64). A bound relative to |output| alone fails where the sum cancels.
    "nvfp4_gemm_vs_dequantized_product": (6 * 2.0 ** -24, 0.0),
    # Two 16-point RHTs in fp32 on both GEMM operands (K = 64, randn), then a float64 product, vs the exact float64
    # product: the RHT is orthogonal, so only its fp32 roundings (<= 15 u per output, of random sign) reach the
    # product; measured 1.5e-6 - 5.0e-6 abs over 300 seeds. Bound 1e-4 abs (20x); a wrong sign or ordering of the
    # transform is O(1).
    "rht_product_fp32": (1e-4, 0.0),
    # The same product with both operands NVFP4-quantised (RHT, nearest rounding, tensor scope) vs exact: relative
    # Frobenius error of 4-bit operands, measured 0.091 - 0.195 over 3000 seeds (rtol). Catches a missing inverse
    # transform or a transform on one operand only (O(1)).
    "nvfp4_gemm_rht_vs_exact": (0.0, 0.25),
    # Statistical checks with fixed seeds (stochastic rounding is unbiased, uniform_u24 fills its histogram evenly):
    # the deviation from the expectation may be this many standard deviations (atol, in sigmas). A false failure for
    # a fresh seed would need a 6-sigma draw (p < 2e-9 each); a biased rounding or a non-uniform hash is off by far
    # more.
    "monte_carlo_sigmas": (6.0, 0.0),
    # Pearson's chi-square of the Gumbel sampler's draws against softmax(logits / T) (tests/rollout/
    # test_sampling.py: 20,000 draws over 6 tokens, 5 degrees of freedom): 35.9 is the 1e-6 upper quantile of the
    # chi-square distribution with 5 degrees of freedom, so a fresh seed fails falsely with p = 1e-6 (every expected
    # count >= 32, which the approximation needs). Measured 4.2 - 7.1 at T = 0.5, 1, 2 (CPU, 2026-12-06); the
    # temperature 15% off gives 90 - 305, the logits' sign flipped > 2.8e4.
    "chi_square_5_dof": (35.9, 0.0),
    # e = -log(u) of the Gumbel sampler (minite.rollout.sampling), relative to float64's -log((w + 0.5) 2^-32) of the
    # word w: the series below u = 1 - 2^-6 is within 1.4 ulp of it (the word's rounding to fp32 included; measured
    # over the 2^26 words of that branch, CPU); elsewhere the device's log of u. A GPU's
    # approximate log (Triton's tl.log: log2 with an absolute error near 2^-22) errs by up to ~2^-22 * ln 2 / e,
    # ~1.1e-5 at the series' edge (e = 0.0155), less beyond. Bound 3e-5; a log of u near 1 without the series is off
    # by up to 100%.
    "gumbel_exponential_rel": (0.0, 3e-5),
    # Log-sum-exp from the Gumbel sampler's pass (kernels/gumbel_sample.py, lse) against float64's, and default-mode
    # log-probs logit - lse against torch's fp32 log_softmax. Absolute errors (nats): log(s), s an fp32 sum of up to V
    # terms in [0, 1] in the kernel's order (a few 2^-24 relative per tree level, ~2^-20 over 17 levels), through the
    # device's exp and log (Triton's approximate ones on a GPU, ~2^-22), and torch's log_softmax's own such error on
    # the other side: atol 2^-19. Relative: one or two roundings of the result on each side (an ulp of |lse| or
    # |logit|), rtol 2^-22 of max(|lse|, |logit|). The GPU's exp of a rounded d log2(e) errs by ~|d| 2^-24 relative
    # per term (d = m - x), which over the terms weighs as sum p d 2^-24 <= log(V) 2^-24 of s: inside atol. Measured
    # under the interpreter: kernel <= 4e-7 and torch 1.1e-6 from float64 at |lse| ~ 10-16 (CPU, 2026-12-06). A wrong
    # merge or a missed chunk errs by O(1).
    "lse_fused": (2.0 ** -19, 2.0 ** -22),
    # The router's softmax over its top-k in one launch (kernels/moe_rows.py routing_topk) against upstream's torch
    # softmax, fp32 probs: each p = e_j / S with e_j the device's exp of an exact difference d = s_j - s_0 <= 0 (on a
    # GPU Triton's ex2.approx of the fp32-rounded d log2(e): a relative error near |d| 2^-24 plus ~2 ulp; p |d| <= 1/e
    # bounds the first part's absolute error by 2^-24: atol), S a k-term fp32 sum in another order (k - 1 roundings,
    # k <= 8), the division (~2 ulp on a GPU) and torch's own roundings: under 16 ulps, rtol 2^-20 of the prob (a
    # review's emulation of the GPU's exp: 4.6e-7 relative at |d| = 10, 3.7e-6 at 80). bf16 logits give bf16 probs: a
    # 1-ulp difference before the cast may round to the neighbouring bf16 value, and the scaling factor's product rounds
    # once more: 2 bf16 ulps, up to 2^-6 of the value at the bottom of a binade. Measured under the interpreter:
    # 4.0e-7 (fp32), 1 bf16 ulp without a factor and 2 with 2.5 (1.2e-2 at 0.66; CPU, 2026-12-06).
    "router_softmax_fused": (2.0 ** -24, 2.0 ** -20),
    "router_softmax_fused_bf16": (0.0, 2.0 ** -6),
    # The router's fp32 logits from bf16 operands in one launch (kernels/moe_rows.py `router_logits`) against the
    # float64 sum of the same (exact) products: fp32 accumulation of K terms, on Hopper tensor cores each MMA step
    # truncating to the largest exponent (<= 1 ulp, 2^-23, a step; the interpreter's fp32 dot: half that). Bound
    # K * 2^-23 * sum_k |x_k w_k| per logit; cuBLAS's fp32 GEMM meets it too (K * 2^-24). atol is relative to
    # K * sum_k |x_k w_k| (the test multiplies by its K: a bf16 rounding of the logits, 2^-9 relative, fails it).
    "router_logits_fused": (2.0 ** -23, 0.0),
    # --- Triton kernels (tests/kernels) ---
    # SwiGLU + fused quantisation, bf16 output vs torch's silu: silu is computed in fp32 with the kernel's exp (the
    # GPU's, or numpy's under the interpreter) instead of torch's; a few fp32 ulps can flip the bf16 rounding of an
    # element by one bf16 step, which is <= 2^-7 relative. Measured 0 under the CPU interpreter (20 seeds).
    "swiglu_kernel_vs_torch_bf16": (0.0, 2.0 ** -7),
    # SwiGLU backward on the kernel vs torch autograd, fp32: the same formula with another exp and order of a few
    # fp32 operations, a few ulps of values of size ~1-10; measured <= 0.013 of this allowance (20 seeds, interpreter).
    "swiglu_bwd_kernel_vs_autograd_fp32": (1e-5, 1e-5),
    # The experts' SwiGLU backward, dprobs (kernels/expert_swiglu.py): the row sum over F <= 1024 of the same fp32
    # products da * (silu(g) * u) in the kernel's order against torch's; each order's error is <= (F - 1) u times the
    # sum of |terms| (u = 2^-24), so the two differ by at most 2 * 1024 * 2^-24 of it. atol is relative to the row's
    # sum of |terms|.
    "expert_swiglu_dprobs_row_sum": (2 * 1024 * 2.0 ** -24, 0.0),
    # --- strict ops vs torch (tests/strict/test_strict_ops.py, tests/alignment/test_strict_alignment_gpu.py) ---
    # strict linear (pairwise fp32 sums, K = 96) vs float64: error <= (log2 K + 2) u * sum_k |a_k b_k| ~ 9 u * 61
    # against max|ref| >= ~20 for these randn operands, ~1.6e-6 of max|ref|; measured 4.5e-8 - 1.4e-7 over 600 draws
    # (bf16 and fp32 operands). rtol is relative to max|ref|.
    "strict_linear_vs_fp64": (0.0, 1e-5),
    # strict linear's backward (ordinary fp32 matmuls of the fp32-rounded operands) vs float64 autograd: each gradient
    # element is a sum of K <= 8 products, each operand rounded to fp32 (u) and the sum in fp32 ((K - 1) u), so the
    # gap is <= (K + 1) u * sum_k |g_k w_k|. atol is relative to that sum (16 u covers K <= 15). A bound relative to
    # the gradient itself (allclose's default) fails on ~10% of random draws, where the K terms cancel.
    "strict_linear_backward_vs_fp64": (16 * 2.0 ** -24, 0.0),
    # strict attention (bf16 inputs, fp32 softmax and P V with strict exp and tree sums) vs torch SDPA in fp32, 11 keys:
    # outputs are convex combinations of values of size ~1, so the gap is a few fp32 ulps of 1; measured 2.4e-7 -
    # 6.0e-7 abs over 300 seeds. Bound 1e-5 abs; a wrong mask or scale is O(0.1).
    "strict_attention_vs_sdpa_fp32": (1e-5, 0.0),
    # strict softmax vs torch.softmax, fp32, 50 columns: both correctly round exp to within an ulp and divide once;
    # measured <= 0.03 of this allowance over 300 seeds.
    "strict_softmax_vs_torch_fp32": (1e-7, 1e-5),
    # strict rms_norm vs torch's, fp32, 50 columns: another summation order of the mean square (a few ulps) times a
    # weight of size ~1; measured <= 0.035 of this allowance over 300 seeds.
    "strict_rms_norm_vs_torch_fp32": (1e-6, 1e-5),
    # strict log_softmax vs float64, 1000 columns, relative to max(|ref|, 1) (atol). The arithmetic bound is about
    # (log2 1000 + 2) u ~ 12 u (the tree sum's error passes into log(sum) at its size); the test's fixed input
    # (seed 0) stays within 4 u, while other seeds reach 4.6 u (measured over 300 seeds): this is tighter than the
    # arithmetic bound and relies on the fixed seed.
    "strict_log_softmax_vs_fp64": (4 * 2.0 ** -24, 0.0),
    # Its gradient vs torch autograd, fp32: softmax - one-hot with another exp and summation order, a few ulps of
    # values <= 1; measured <= 0.063 of this allowance over 300 seeds.
    "strict_log_softmax_grad_vs_torch_fp32": (1e-6, 1e-5),
    # A strict op vs its autograd twin (minite.strict.ops._StrictForward: the same function in torch's fp32 ops,
    # whose gradient the learner takes): another summation order and exp/log rounding, values of size <= ~10 over 40
    # columns or 7 keys, so a few fp32 ulps apart; measured <= 0.038 of this allowance (1.9e-6 abs) over 300 seeds
    # (2026-12-05, the test's cases with shifted seeds). A wrong mask, scale or formula is O(0.1).
    "strict_op_vs_its_autograd_twin_fp32": (1e-5, 1e-5),
    # The fixed-K Triton GEMM (bf16/fp16 operands, fp32 output, K = 1024) vs torch's fp32 matmul on the GPU: both sum
    # exact products in fp32, the tensor cores truncating (tolerance nvfp4_gemm_tensorcore_acc): <= K * 2^-23 *
    # sum_k |a_k b_k| ~ 1.2e-4 * 650 against max|ref| >= ~150 for randn operands, ~5e-4 of max|ref|. rtol is
    # relative to max|ref|; a wrong tile offset or K step is O(1).
    "fixed_k_gemm_vs_fp32": (0.0, 1e-3),
    # --- RL maths and alignment statistics (tests/rl/test_grpo.py, tests/alignment/test_compare.py) ---
    # group_advantages divides by std + 1e-6, so a group's advantages are scaled by std / (std + 1e-6) = 1 - 1e-6 /
    # std: measured 2.0e-6 off +-1 for a group of (1, 0) (std 0.5) and 8.3e-7 off unit std for (0, 1, 2, 3).
    "grpo_advantage_eps": (1e-5, 1e-5),
    # ... while their mean stays 0 up to fp64 rounding and the cast to fp32 (measured exactly 0 for (0, 1, 2, 3)).
    "grpo_advantage_mean": (1e-6, 0.0),
    # A fraction of token counts (clip_frac, is_masked_frac) computed in fp32 vs the float64 fraction: one fp32
    # rounding, <= 2^-24 relative; rtol 1e-6 is looser than needed (17 ulps).
    "fp32_count_fraction": (0.0, 1e-6),
    # TIS weights exp(log(w)) in fp32 vs w: log and exp each round by <= 1 ulp, so the round trip is a few ulps
    # (measured 1.5e-8 abs for w = 0.2); these are allclose's defaults, kept explicit.
    "fp32_exp_log_roundtrip": (1e-8, 1e-5),
    # The K3 KL of one token at log-ratio -0.5 in fp32 (expm1(x) - x) vs float64: expm1 is within an ulp and the
    # difference 0.1065 rounds once, <= ~3e-7 relative; measured 6.2e-8.
    "grpo_k3_fp32": (0.0, 1e-6),
    # Monte Carlo mean of K3 over 400 000 normal samples (fixed seed) vs KL = 0.045: standard error 1.0e-4,
    # measured -1.6e-4; 2e-3 is 20 standard errors, looser than needed.
    "k3_monte_carlo": (2e-3, 0.0),
    # GRPO loss split into chunks whose shares add up (rl.micro_batches) vs the whole batch, fp32: the same terms
    # summed in another grouping (per chunk, then over chunks) and divided before instead of after the sum; each of
    # the few dozen terms carries O(1) magnitude, so the difference is a few ulp of fp32 (2^-23) of the result.
    "grpo_chunk_shares_fp32": (1e-6, 1e-5),
    # One BF16 RL step with rl.micro_batches=2 vs 1 (tests/rl/test_rl_step.py): the same rollout, but the learner
    # forwards chunks of rows instead of the whole minibatch (CPU BF16 GEMMs may block rows differently), sums the
    # chunks' gradients into fp32 main_grad (another order), and the minibatches' second step starts from weights that
    # differ by that rounding (bf16, 2^-8). Measured (2026-12-04, this project's CPU machine, the test's batch): loss
    # 1.5e-4, gradient norm 5.1e-4 and the small KL (3.2e-3) 7.1e-3 relative apart (relative only: every compared
    # value is checked to be far from 0); a wrong share (a chunk's loss over its own tokens, or metrics not rescaled
    # by the chunk count) is off by O(1), 0.5 relative at 2 chunks.
    "micro_batches_vs_whole_bf16_step": (0.0, 2e-2),
    # The same two runs' bf16 weights after the step (|w| <= 1): the accumulated fp32 gradients differ by rounding, so
    # an Adam update can land a bf16 ulp apart (2^-9 below 0.5, 2^-8 below 1). Measured 1.4e-3 (2026-12-04).
    "micro_batches_vs_whole_bf16_weights": (2.0 ** -8, 0.0),
    # Log-prob metrics computed in float64 (mismatch_metrics, logprob_gap) vs the hand-computed values: the inputs
    # carry one fp64 rounding (-1.1, -0.5 + 1e-3), the outputs a few more, ~1e-16 absolute on values ~0.005 - 0.1,
    # i.e. <= ~1e-13 relative; both bounds are looser than needed, and far below an fp32 cast (~1e-8).
    "fp64_logp_metrics": (1e-12, 1e-9),
    # The RL job at TP = 2 (tests/rl/test_tp_job.py, two gloo ranks, the tiny config): the learner's log-probs come
    # from Megatron's vocabulary-parallel log-softmax (two shards' sums added) and the engine's from one log-softmax
    # over the gathered logits, both in fp32; measured 2.4e-7 - 4.8e-7 per step in NVFP4 over 10 steps, and in BF16
    # one step of ten at 3.0e-4 (a bf16 rounding the two sides take on different sums). The bound (absolute, nats)
    # sits between those and the drift of TP ranks that clip differently (>= 1e-3 after one step, 3.4e-3 - 1.4e-2
    # from the first RL step after warm-up: docs/upstream.md).
    "tp2_rl_logp_gap": (1e-3, 0.0),
    # `minite diagnose` at TP = 2 (tests/alignment/test_diagnose_tp.py, BF16, tiny config): every captured op agrees
    # bitwise, and the log-probs differ only by the learner's vocabulary-parallel log-softmax against the engine's
    # log-softmax over the gathered logits (fp32, the sum of exps in another order): measured 2.4e-7 max over 48
    # tokens. 1e-5 (absolute, nats) is 40x that; a layout error gives >= 1e-2.
    "tp2_diagnose_logp_gap": (1e-5, 0.0),
    # --- engines end to end (tests/alignment/test_strict_alignment.py, tests/rollout/sglang/test_engine.py) ---
    # Learner vs embedded engine in BF16 default mode with routing replay (not strict: nothing makes the two bitwise
    # equal by construction). On this CPU the gap is 0 (measured: diagnose on 3 prompt seeds, the RL step on 2 run
    # seeds; docs/alignment.md: 0 at 16 x 8); on a host whose kernels differ between prefill and decode shapes a
    # flipped BF16 rounding (2^-8 relative) of an activation moves a log-prob by ~1e-3 (the H200 medium model: max
    # 1.2e-2, docs/alignment.md). The bounds are
    # chosen, not derived: 1e-3 for diagnose (4 prompts x 6 tokens), 1e-2 for one RL step (the RL-step metric over
    # 8 sequences x 4 tokens); both are looser than needed here. Without replay a route flip gives O(0.1).
    "routing_replay_bf16_diagnose_gap": (1e-3, 0.0),
    "routing_replay_bf16_rl_step_gap": (1e-2, 0.0),
    # SGLang's sampled log-probs (decode, one token at a time with a KV cache) vs its teacher-forced prefill log-probs
    # of the same tokens, CPU: another summation order in attention, measured 0 - 5e-7 abs. 1e-4 is > 100x that and
    # < 1e-3 of the effect tested (tempered log-probs near -4.5 would be off by ~3x).
    "sglang_decode_vs_prefill_logp": (1e-4, 0.0),
    # The embedded engine's first sampled position of its shortest prompts in default mode on a GPU, observed
    # (engine.observed(): the prefill's lm_head over every prompt position) against plain (over the last ones only,
    # minite/rollout/decode.py): cuBLAS may pick another kernel for the other row count, whose fp32 sums can round a
    # bf16 logit to its neighbour. The tiny test model's logits are near-uniform (log-probs ~ -log(vocab)) and below 2
    # in magnitude, where a bf16 step is <= 2^-7: the token's logit and the log-sum-exp each move by at most that.
    # Bound 2^-6 nats; measured 4.8e-7 on an H100 (2026-12-07, 29c3e4e). A wrong row or position is a different
    # token's log-prob (this model's differ by ~0.1-0.5 between positions); every other position stays bitwise.
    "observed_prefill_logprob_gpu": (2.0 ** -6, 0.0),
}
