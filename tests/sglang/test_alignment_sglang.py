"""`minite diagnose` against the SGLang backend on CPU: the per-token gap is measured (ops are not: SGLang runs its
model in a scheduler process), and strict mode is refused with a clear error (it is implemented for the embedded
backend only)."""
from __future__ import annotations

import math

import pytest

from tests.sglang.conftest import sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def test_diagnose_learner_vs_sglang_measures_the_gap():
    from minite.alignment.diagnose import DiagnoseParams, run_diagnose
    from minite.config import load_config

    cfg = load_config("examples/tiny/nvfp4.yaml", ["model.max_position_embeddings=32"])
    r = run_diagnose(cfg, b="sglang", params=DiagnoseParams(num_prompts=4, max_new_tokens=4))
    assert r["b"] == "sglang" and r["tokens_compared"] == 16 and not r["ops_captured"]
    assert math.isfinite(r["max_abs_logp_gap"]) and r["max_abs_logp_gap"] >= r["mean_abs_logp_gap"] >= 0
    assert r["first_divergent_op"] is None and r["origin"] is None


def test_strict_mode_with_sglang_is_refused():
    from minite.alignment.diagnose import build_pair
    from minite.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="embedded"):
        load_config("examples/tiny/nvfp4.yaml", ["alignment.strict=true", "rollout.backend=sglang"])
    cfg = load_config("examples/tiny/nvfp4.yaml", ["alignment.strict=true"])
    with pytest.raises(ValueError, match="embedded backend only"):
        build_pair(cfg, "sglang")
