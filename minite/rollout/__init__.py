"""Rollout engines behind one interface: the embedded Megatron-Core engine and SGLang."""
