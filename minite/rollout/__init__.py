"""Rollout engines behind one interface (base.RolloutEngine): the embedded Megatron-Core engine and SGLang.

`make_engine(cfg)` picks the backend named by cfg.rollout.backend:
    embedded   Megatron-Core's static inference engine in-process, over build_model(cfg) (embedded.py)
    sglang     SGLang's offline engine with the minite_nvfp4 plugin (sglang/engine.py, docs/sglang.md)
"""
from minite.rollout.base import RolloutEngine, RolloutResult, SamplingParams, WeightUpdateError

BACKENDS = ("embedded", "sglang")


def make_engine(cfg, *, pad_id: int = 0) -> RolloutEngine:
    backend = cfg.rollout.backend
    # Each backend's module imports its upstream (Megatron-Core, SGLang): only the one asked for is imported.
    if backend == "embedded":
        from minite.rollout.embedded import build_embedded

        return build_embedded(cfg, pad_id=pad_id)
    if backend == "sglang":
        from minite.rollout.sglang.engine import build_sglang

        return build_sglang(cfg, pad_id=pad_id)
    raise ValueError(f"unknown rollout.backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["RolloutEngine", "RolloutResult", "SamplingParams", "WeightUpdateError", "make_engine", "BACKENDS"]
