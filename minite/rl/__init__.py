"""The RL loop: tasks with verifiable rewards, GRPO, checkpoints, metrics."""
