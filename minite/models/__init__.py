"""Model families: each module owns one family's shape type and Hugging Face config (qwen3_moe.py: Qwen3-MoE).
A second family is a new module here (plus its Megatron spec in megatron_patches/), not edits across the tree."""
