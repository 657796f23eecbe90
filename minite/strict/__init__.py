"""Strict mode's batch-invariant ops: every output a fixed function of its own inputs, whatever the batch, row
position or number of keys (docs/nvfp4.md, docs/alignment.md).

    ops.py          rms_norm, linear, softmax, log_softmax, token_log_softmax, silu, exp/log, sincos, rope, attention,
                    topk: fixed-order (tree) sums, transcendentals through fp64 polynomials; exact on every device by
                    IEEE rules
    triton_gemm.py  on CUDA, the BF16 GEMMs of `ops.linear` through one fixed-K Triton kernel (its tile by shape)
    fused.py        `ops.exp`, `ops.rms_norm`, `ops.tree_sum`, `ops.log`, `ops.rope` and `ops.sincos` each in one
                    Triton kernel on CUDA (the same bits)
    fused_attention.py  `ops.attention` in Triton on CUDA (the same bits; one program a head for a short context,
                    over chunks of keys in four launches for a long one)
    fused_linear.py `ops.linear`'s fp32 path (the strict router) in one Triton kernel on CUDA (the same bits)
    fused_combine.py  the strict MoE combine (minite.ops.combine_fixed_order) in one Triton kernel on CUDA (same bits)
    fused_swiglu.py the strict expert SwiGLU fused with FC2's NVFP4 quantisation (minite.kernels.nvfp4_swiglu's kernel
                    with `ops.silu`'s arithmetic)
    fused_log_softmax.py  `ops.token_log_softmax` (the log-softmax at one index per row, a sampler's log-prob) in
                    three Triton launches over blocks of the row on CUDA (the same bits)

Switching an engine's model to these ops is the engine's job: megatron_patches.strict (Megatron-Core, the learner
and the embedded rollout) and minite.rollout.sglang.strict (SGLang). Both take strict mode as an explicit setting.
"""
