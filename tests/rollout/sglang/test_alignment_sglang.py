"""`minite diagnose` against the SGLang backend on CPU: the per-token gap is measured (ops are not: SGLang runs its
model in a scheduler process); in strict mode (minite.rollout.sglang.strict) it is exactly 0, NVFP4 and BF16, for
batches of different sizes and prompt lengths, with a cached prefix, and after a training step and a weight sync."""
from __future__ import annotations

import math

import pytest
import torch

from tests.rollout.sglang.conftest import sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_diagnose_learner_vs_sglang_measures_the_gap():
    from minite.alignment.diagnose import DiagnoseParams, run_diagnose
    from minite.config import load_config

    cfg = load_config("examples/tiny/nvfp4.yaml", ["model.max_position_embeddings=32"])
    r = run_diagnose(cfg, b="sglang", params=DiagnoseParams(num_prompts=4, max_new_tokens=4))
    assert r["b"] == "sglang" and r["tokens_compared"] == 16 and not r["ops_captured"]
    assert math.isfinite(r["max_abs_logp_gap"]) and r["max_abs_logp_gap"] >= r["mean_abs_logp_gap"] >= 0
    assert r["first_divergent_op"] is None and r["origin"] is None


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_strict_mode_gives_zero_gap_with_sglang(precision):
    from minite.alignment.diagnose import DiagnoseParams, build_pair, diagnose_pair
    from minite.config import load_config

    cfg = load_config("examples/tiny/nvfp4.yaml", ["model.max_position_embeddings=32", "alignment.strict=true",
                                                   "rollout.backend=sglang", f"precision.mode={precision}"])
    learner, engine = build_pair(cfg, "sglang")
    batches = [DiagnoseParams(num_prompts=3, min_prompt_len=2, max_prompt_len=12, max_new_tokens=5, seed=1),
               DiagnoseParams(num_prompts=9, min_prompt_len=1, max_prompt_len=16, max_new_tokens=4, seed=2)]
    try:
        # the second batch runs twice: SGLang's radix cache then serves its prompts' K/V from the first run
        for p in batches + batches[1:]:
            r = diagnose_pair(learner, engine, cfg, p, "sglang")
            assert r["strict"] and r["tokens_compared"] == p.num_prompts * p.max_new_tokens
            assert len(set(r["prompt_lengths"])) > 1
            assert r["max_abs_logp_gap"] == 0.0 and r["mean_abs_logp_gap"] == 0.0, r["max_abs_logp_gap"]
        tokens = torch.randint(1, cfg.model.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
        learner.train_step(tokens, lambda logp: (-logp.mean(), {}))
        engine.update_weights(learner.named_weights())
        r = diagnose_pair(learner, engine, cfg, batches[0], "sglang")
        assert r["max_abs_logp_gap"] == 0.0, r["max_abs_logp_gap"]
    finally:
        engine.shutdown()
