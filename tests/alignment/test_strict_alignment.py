"""Strict alignment end to end on CPU: the real Learner against the embedded Megatron-Core engine.

Strict mode must give an exactly zero log-prob gap (not a small one) on every generated token, for BF16 and NVFP4,
across batch sizes and prompt lengths (the engine's prefill covers the shortest prompt, then decodes one position
per step with its KV cache, so varying both varies every shape the engine runs). `minite diagnose` must name a
deliberately perturbed op as the local origin of a divergence, and routing replay must run in default mode.
"""
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from minite.alignment.diagnose import DiagnoseParams, build_pair, diagnose_pair, run_diagnose
from minite.config import load_config
from minite.rollout import SamplingParams
from tests.tolerances import TOLERANCES

SHAPES = [  # (prompts, shortest prompt, longest prompt, new tokens)
    (1, 2, 2, 5),
    (3, 1, 9, 4),
    (8, 2, 12, 6),
]


def _cfg(*sets):
    return load_config("examples/tiny/nvfp4.yaml", ["model.max_position_embeddings=32", *sets])


@pytest.fixture(scope="module", params=["bf16", "nvfp4", "nvfp4-fp32"])
def strict_pair(request):
    """fp32 compute too: on this CPU its default mode has a non-zero gap (core attention, docs/alignment.md)."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    mode, _, compute = request.param.partition("-")
    cfg = _cfg(f"precision.mode={mode}", "alignment.strict=true",
               f"precision.compute_dtype={'float32' if compute == 'fp32' else 'bfloat16'}")
    learner, engine = build_pair(cfg)
    return cfg, learner, engine


@pytest.mark.parametrize("prompts,lo,hi,new", SHAPES)
def test_strict_mode_gap_is_exactly_zero(strict_pair, prompts, lo, hi, new):
    cfg, learner, engine = strict_pair
    params = DiagnoseParams(num_prompts=prompts, min_prompt_len=lo, max_prompt_len=hi, max_new_tokens=new,
                            seed=prompts)
    r = diagnose_pair(learner, engine, cfg, params)
    assert r["tokens_compared"] == prompts * new
    assert r["max_abs_logp_gap"] == 0.0 and r["mean_abs_logp_gap"] == 0.0, r["histogram"]
    assert r["first_divergent_op"] is None and r["origin"] is None
    assert r["route_flips"] == 0 and r["ops_compared"] >= 20


def test_strict_mode_switched_the_ops(strict_pair):
    cfg, learner, engine = strict_pair
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in engine.model.modules() if isinstance(m, TopKRouter)]
    assert routers and all("strict" in m.forward.__func__.__module__ for m in routers)
    assert learner.strict and engine.strict and getattr(learner.model.config, "minite_strict", False)


def test_strict_rollout_logprobs_do_not_depend_on_the_batch(strict_pair):
    """A prompt's sampled tokens and log-probs are the same alone and inside a batch of other prompts."""
    cfg, learner, engine = strict_pair
    prompts = [[3, 5, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 4]]
    sp = SamplingParams(max_new_tokens=4, seed=3, temperature=1e-3)  # near-greedy: tokens cannot depend on RNG order
    together = engine.generate(prompts, sp)
    alone = engine.generate([prompts[0]], sp)[0]
    assert together[0].tokens == alone.tokens and together[0].logprobs == alone.logprobs


def test_diagnose_names_a_perturbed_rmsnorm_as_local_origin():
    name = "decoder.layers.1.pre_mlp_layernorm"

    def perturb(model):
        for n, m in model.named_modules():
            if n.endswith(name):
                m.eps = 0.05

    r = run_diagnose(_cfg("alignment.strict=true"), perturb=perturb, params=DiagnoseParams(num_prompts=4))
    assert r["first_divergent_op"] == name and r["origin"] == "local"
    assert r["max_abs_logp_gap"] > 0
    later = [d for d in r["ops"] if d["name"] == "decoder.layers.1.mlp.router"][0]
    assert later["input_max_abs"] > 0  # downstream ops see the difference: propagated, not local


def test_diagnose_cli_json_and_fail_above(tmp_path):
    from minite.alignment.cli import run

    out = tmp_path / "d.json"
    args = SimpleNamespace(config="examples/tiny/nvfp4.yaml", b="embedded", json_out=str(out), fail_above=0.0,
                           overrides=["alignment.strict=true"], prompts=3, max_new_tokens=3, seed=1)
    assert run(args) == 0
    r = json.loads(out.read_text())
    for key in ("max_abs_logp_gap", "mean_abs_logp_gap", "tokens_compared", "first_divergent_op", "origin"):
        assert key in r
    assert r["max_abs_logp_gap"] == 0 and r["tokens_compared"] == 9


def test_routing_replay_runs_in_default_mode():
    cfg = _cfg("precision.mode=bf16", "alignment.routing_replay=true")
    r = run_diagnose(cfg, params=DiagnoseParams(num_prompts=4))
    assert r["routing_replay"] and r["route_flips"] is None and r["tokens_compared"] == 4 * 6
    assert r["max_abs_logp_gap"] < TOLERANCES["routing_replay_bf16_diagnose_gap"][0]


RL_TINY = {"rl.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.task_length": 3,
           "model.max_position_embeddings": 16, "logging.progress_bar": False, "rl.steps": 1, "rl.minibatches": 2}


def _rl_cfg(tmp_path, **extra):
    sets = {**RL_TINY, "logging.dir": str(tmp_path / "logs"), **extra}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def test_rl_step_in_strict_mode_has_zero_mismatch_and_monitor_passes(tmp_path):
    from minite.rl.loop import train

    m = train(_rl_cfg(tmp_path, **{"alignment.strict": "true", "alignment.stop_above": 0.0}))[0]
    assert m["mismatch/logp_abs_max"] == 0.0 and m["mismatch/k3_kl"] == 0.0


def test_rl_step_with_routing_replay(tmp_path):
    from minite.rl.loop import train

    m = train(_rl_cfg(tmp_path, **{"precision.mode": "bf16", "alignment.routing_replay": "true"}))[0]
    assert m["mismatch/logp_abs_max"] < TOLERANCES["routing_replay_bf16_rl_step_gap"][0]
    assert m["loss/policy"] == m["loss/policy"]  # not NaN


def test_rl_loop_stops_when_the_gap_crosses_stop_above(tmp_path):
    """An engine whose final norm uses another epsilon: the first step's gap is > 0 and the monitor stops it."""
    from minite.alignment.monitor import AlignmentError
    from minite.rl import loop

    run = loop.setup(_rl_cfg(tmp_path, **{"alignment.strict": "true", "alignment.stop_above": 0.0}))
    for name, module in run.engine.model.named_modules():
        if name.endswith("decoder.final_layernorm"):
            module.eps = 0.5
    with pytest.raises(AlignmentError, match="stop_above"):
        loop.rl_step(run)
    assert run.step == 0  # nothing was trained on the off-policy step


def test_strict_rollout_and_learner_take_the_strict_log_softmax(strict_pair, monkeypatch):
    from minite.strict import ops as strict_ops

    cfg, learner, engine = strict_pair
    calls = []
    real = strict_ops.log_softmax
    monkeypatch.setattr(strict_ops, "log_softmax", lambda x, dim=-1: calls.append(x.shape) or real(x, dim))
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert len(calls) >= 3  # one per generated token, inside Megatron's controller
    import megatron.core.inference.text_generation_controllers.text_generation_controller as tgc
    assert tgc.F is torch.nn.functional  # restored after generate
    calls.clear()
    learner.logprobs(torch.tensor([[1, 2, 3, 4]]))
    assert len(calls) == 1


def test_strict_learner_logprobs_under_autograd_are_its_no_grad_ones(strict_pair):
    """The RL loss's log-probs (recorded for the backward, train mode) are bit for bit the old log-probs (no grad,
    eval mode): in strict mode the first minibatch's importance ratio is exactly 1 (minite.strict.ops._StrictForward
    computes each op's value with nothing recorded)."""
    cfg, learner, engine = strict_pair
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2]])
    want = learner.logprobs(tokens)
    got = learner._batch_logprobs(tokens)
    assert got.requires_grad and torch.equal(got.detach(), want)
