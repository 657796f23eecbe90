"""Rollout engines behind one interface (base.RolloutEngine): the embedded Megatron-Core engine and SGLang.

`make_engine(cfg)` picks the backend named by cfg.rollout.backend:
    embedded   Megatron-Core's static inference engine in-process, over build_model(cfg) (embedded.py)
    sglang     not implemented yet (the SGLang rollout issue)
"""
from minite.rollout.base import RolloutEngine, RolloutResult, SamplingParams, WeightUpdateError

BACKENDS = ("embedded", "sglang")


def make_engine(cfg, *, pad_id: int = 0) -> RolloutEngine:
    backend = cfg.rollout.backend
    if backend == "embedded":
        from minite.rollout.embedded import build_embedded

        return build_embedded(cfg, pad_id=pad_id)
    if backend == "sglang":
        raise NotImplementedError(
            "rollout.backend='sglang' is not implemented yet (it lands with the SGLang rollout issue); "
            "use rollout.backend='embedded'"
        )
    raise ValueError(f"unknown rollout.backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["RolloutEngine", "RolloutResult", "SamplingParams", "WeightUpdateError", "make_engine", "BACKENDS"]
