"""Everything that plugs into or patches Megatron-Core 0.16.1 (installed as minite.megatron_patches).

The folder is the top-level megatron_patches/ of the repository, installed under the minite namespace (setup.py's
package_dir). Each module says at its top what it changes in Megatron-Core, why, and which version it targets;
each patch has one idempotent entry point that logs what it patched.

cpu.py           Megatron-Core on CPU with gloo (apply()), fixes needed on every device (apply_upstream_fixes()),
                 and the CUDA no-ops of the static inference path (cpu_generate_shims())
nvfp4_layers.py  NVFP4 column/row-parallel linears and grouped experts (BF16 or NVFP4), Megatron module subclasses
moe_dispatch.py  a MoE token dispatcher for EP = 1 without host synchronisation (the embedded engine's; same bits)
qwen3_moe.py     the Qwen3-MoE GPTModel spec builder (from minite.models.qwen3_moe's shape), SDPA core attention
rope.py          Megatron's apply_rotary_pos_emb dispatched per call (strict, one-launch CUDA inference, upstream);
                 a static KV cache that holds roped keys
strict.py        strict mode: switch a built model's ops to minite.strict's batch-invariant ops (apply_strict)
weight_copy.py   the optimizer's master -> weight copy of the NVFP4 expert weights with their amax (one launch each)
grad_stats.py    the expert optimizer's gradient norm counted by expert TP rank (one clip factor on every TP rank)
"""
