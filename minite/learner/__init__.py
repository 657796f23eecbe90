"""The learner: Megatron-Core model building, NVFP4 op functions used by its layers, the training step."""
