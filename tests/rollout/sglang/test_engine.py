"""The `sglang` rollout backend end to end: a real SGLang offline Engine (CPU) on a tiny random Qwen3-MoE, computing
with the minite_nvfp4 plugin, generating with per-token log-probs and taking weight updates from learner tensors.

One engine start for the whole module (about 20-40 s on the 2-core dev machine); each test reuses it and leaves it on
the initial weights. Comparisons between calls decode greedily (temperature 1e-6, which SGLang treats as greedy):
SGLang honours sampling seeds only in its deterministic mode, which needs a GPU attention backend.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.rollout.sglang.conftest import sglang_skip_reason, tiny_hf_checkpoint
from tests.tolerances import TOLERANCES

_REASON = sglang_skip_reason()
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _learner_tensors(hf_dir):
    """The tiny model's tensors under the learner's (Megatron) names, as learner.named_weights() gives them."""
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf

    cfg = json.loads((hf_dir / "config.json").read_text())
    return cfg, [(n, t.clone()) for n, t in megatron_view_of_hf(_HFReader(hf_dir), cfg)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from minite.nvfp4 import NVFP4Recipe
    from minite.rollout.sglang.engine import start_from_learner_tensors

    cfg, w1 = _learner_tensors(tiny_hf_checkpoint(tmp_path_factory.mktemp("w1"), seed=1))
    _, w2 = _learner_tensors(tiny_hf_checkpoint(tmp_path_factory.mktemp("w2"), seed=2))
    cfg.pop("eos_token_id", None)
    engine = start_from_learner_tensors(w1, cfg, NVFP4Recipe())
    print(f"\nsglang engine start-up: {engine.startup_seconds:.1f} s")
    yield engine, w1, w2
    engine.shutdown()


def _params(**kw):
    from minite.rollout.base import SamplingParams

    return SamplingParams(**{"temperature": 1e-6, "max_new_tokens": 6, "n": 2, "seed": 7, **kw})


def _run(engine, **kw):
    return [(r.prompt_index, r.tokens, r.logprobs, r.finished) for r in engine.generate(PROMPTS, _params(**kw))]


def test_generate_returns_grouped_samples_with_logprobs_reproducibly(setup):
    engine, _w1, _w2 = setup
    cpu_rng = torch.get_rng_state()
    out = engine.generate(PROMPTS, _params())
    assert torch.equal(cpu_rng, torch.get_rng_state()), "generate must not touch the global RNG"
    assert [r.prompt_index for r in out] == [0, 0, 1, 1]
    assert out[0].prompt == PROMPTS[0] and out[2].prompt == PROMPTS[1]
    for r in out:
        assert len(r.tokens) == len(r.logprobs) == 6 and not r.finished
        assert all(0 <= t < 128 for t in r.tokens)
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
    assert _run(engine) == [(r.prompt_index, r.tokens, r.logprobs, r.finished) for r in out]
    assert out[0].tokens == out[1].tokens  # greedy: a group's samples agree
    sampled = engine.generate([PROMPTS[0]], _params(temperature=1.0, n=4, max_new_tokens=8))
    assert len({tuple(r.tokens) for r in sampled}) > 1  # at temperature 1 they differ
    # log-probs are the untempered policy's: a token's log-prob does not depend on the sampling temperature
    for r in sampled:
        if r.tokens[0] == out[0].tokens[0]:
            assert r.logprobs[0] == out[0].logprobs[0]


def test_stop_token_ends_and_is_kept(setup):
    engine, _w1, _w2 = setup
    first = engine.generate([PROMPTS[0]], _params(n=1))[0]
    stop = first.tokens[2]
    cut = engine.generate([PROMPTS[0]], _params(n=1, stop_token_id=stop))[0]
    k = first.tokens.index(stop) + 1
    assert cut.finished and cut.tokens == first.tokens[:k] and cut.logprobs == first.logprobs[:k]


def test_weight_update_takes_effect_and_round_trips_exactly(setup):
    engine, w1, w2 = setup
    before = _run(engine)
    engine.update_weights(w2)
    after = _run(engine)
    assert after != before
    engine.update_weights([("module." + n, t) for n, t in w1])  # a wrapper prefix is ignored
    assert _run(engine) == before  # same packed weights -> the same tokens and log-probs, bit for bit


def test_rejected_update_raises_and_keeps_weights(setup):
    from minite.rollout.base import WeightUpdateError

    engine, w1, w2 = setup
    before, version = _run(engine), engine.weight_version
    bad_shape = [(n, t[:-1] if i == 3 else t) for i, (n, t) in enumerate(w2)]
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.update_weights(bad_shape)
    with pytest.raises(WeightUpdateError, match="missing"):
        engine.update_weights(w2[:-1])
    nan = [(n, torch.full_like(t, float("nan")) if i == 0 else t) for i, (n, t) in enumerate(w2)]
    with pytest.raises(WeightUpdateError, match="finite"):
        engine.update_weights(nan)
    assert _run(engine) == before and engine.weight_version == version


def test_failure_inside_sglang_restores_previous_weights(setup, monkeypatch):
    import minite.rollout.sglang.engine as E
    from minite.rollout.base import WeightUpdateError

    engine, _w1, w2 = setup
    before = _run(engine)
    real_buckets, real_update = E.iter_buckets, engine.engine.update_weights_from_tensor
    calls, sent = [], []

    def half_buckets(packed, *args):  # SGLang dies half way through: half the new tensors are already in place
        calls.append(len(packed))
        return real_buckets(packed[: len(packed) // 2], *args)

    def fail_first(payloads, **kw):
        result = real_update(payloads, **kw)
        sent.append(1)
        return (False, "injected failure") if len(sent) == 1 else result

    monkeypatch.setattr(E, "iter_buckets", half_buckets)
    monkeypatch.setattr(engine.engine, "update_weights_from_tensor", fail_first)
    with pytest.raises(WeightUpdateError, match="injected failure.*kept its previous weights"):
        engine.update_weights(w2)
    monkeypatch.undo()
    assert len(calls) == 1 and len(sent) == 2 and _run(engine) == before  # the restore sent the last good bucket


def test_sampled_logprobs_are_the_untempered_policy(setup):
    """At temperature 0.3 the reported log-probs equal SGLang's teacher-forced (prefill, temperature-free) log-probs of
    the same tokens; tempered ones would be about 3x larger in magnitude (log-probs near -4.5 here)."""
    engine, _w1, _w2 = setup
    out = engine.generate([PROMPTS[0]], _params(temperature=0.3, n=3, max_new_tokens=3))
    for r in out:
        check = engine.engine.generate(input_ids=PROMPTS[0] + r.tokens, return_logprob=True,
                                       logprob_start_len=len(PROMPTS[0]) - 1,
                                       sampling_params={"temperature": 0, "max_new_tokens": 1})
        prefill = [lp for lp, _t, _s in check["meta_info"]["input_token_logprobs"]][1:]
        # Not bitwise: prefill attends over the whole sequence at once, decode one token at a time with a KV cache
        # (different summation order in attention; TOLERANCES["sglang_decode_vs_prefill_logp"] says how far).
        gap = max(abs(a - b) for a, b in zip(r.logprobs, prefill))
        assert gap < TOLERANCES["sglang_decode_vs_prefill_logp"][0]
