"""One RL step of the real loop (Megatron-Core learner in NVFP4) with the `sglang` rollout backend on CPU.

The loop is built with `engine_factory=build_sglang`, what `rollout.backend: sglang` selects through make_engine.
Checks that rollouts, rewards, the learner/rollout log-prob mismatch metrics and the weight sync all run, and prints
the mismatch (SGLang's attention/norm/router kernels differ from Megatron's; the NVFP4 GEMMs are shared).
"""
from __future__ import annotations

import math

import pytest

from tests.rollout.sglang.conftest import sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_one_rl_step_with_the_sglang_backend(tmp_path):
    from minite.config import load_config
    from minite.rl.loop import rl_step, setup
    from minite.rollout.sglang.engine import SGLangEngine, build_sglang

    sets = {"rollout.backend": "sglang", "precision.mode": "nvfp4", "rl.steps": 1, "rl.warmup_steps": 0,
            "rl.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.task_length": 3,
            "model.max_position_embeddings": 16, "logging.progress_bar": False, "logging.dir": str(tmp_path / "logs"),
            "checkpoint.dir": str(tmp_path / "ck")}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    run = setup(cfg, engine_factory=build_sglang)
    try:
        assert isinstance(run.engine, SGLangEngine) and run.engine.weight_version >= 1  # setup synced once
        version = run.engine.weight_version
        metrics = rl_step(run)
        assert run.engine.weight_version == version + 1
        gaps = {k: v for k, v in metrics.items() if "mismatch" in k or "logp" in k}
        assert gaps and all(math.isfinite(float(v)) for v in gaps.values())
        print("\nsglang vs learner:", {k: round(float(v), 5) for k, v in sorted(gaps.items())})
    finally:
        run.engine.shutdown()
