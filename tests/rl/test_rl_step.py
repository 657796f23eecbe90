"""End to end on CPU: the real Learner (Megatron-Core, NVFP4 W4A4) with the embedded Megatron rollout engine.

One RL step through `minite train`'s code path, TensorBoard tags, the engine's contract (seeded sampling,
log-probs the learner reproduces, all-or-nothing weight updates), bitwise resume with the real learner, and
the clear errors for a bad config key, a bad checkpoint and an unimplemented backend.
"""
import json
import math
from pathlib import Path

import pytest
import torch

from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl.loop import train
from minite.rl.metrics import TAGS
from minite.rollout import SamplingParams, WeightUpdateError, make_engine
from tests.tolerances import FP32_EPS, TOLERANCES

TINY = {"rl.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.task_length": 3,
        "model.max_position_embeddings": 16, "logging.progress_bar": False}


def _cfg(tmp_path, **extra):
    sets = {**TINY, "logging.dir": str(tmp_path / "logs"), **extra}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_one_rl_step_nvfp4_end_to_end(tmp_path):
    cfg = _cfg(tmp_path, **{"rl.steps": 1, "precision.mode": "nvfp4", "rl.warmup_steps": 1, "rl.kl_coef": 0.05,
                            "rl.minibatches": 2, "rl.is_correction": "mis", "checkpoint.dir": str(tmp_path / "ck")})
    history = train(cfg)
    assert len(history) == 1
    m = history[0]
    for tag in TAGS:
        assert math.isfinite(m[tag]), tag
    assert 0 <= m["reward/mean"] <= 1 and m["mismatch/logp_abs_max"] >= m["mismatch/logp_abs_mean"] >= 0
    logged = _scalars(tmp_path / "logs")
    assert set(TAGS) <= set(logged), sorted(set(TAGS) - set(logged))
    assert ckpt.latest_checkpoint(tmp_path / "ck").name == "step_000001"


@pytest.fixture(scope="module")
def learner_and_engine():
    from minite.learner.learner import Learner

    cfg = load_config(None, ["precision.mode=nvfp4", "model.max_position_embeddings=16"])
    learner = Learner(cfg)
    engine = make_engine(cfg)
    engine.update_weights(learner.named_weights())
    return learner, engine


def test_engine_sampling_is_seeded_and_logprobs_match_the_learner(learner_and_engine):
    learner, engine = learner_and_engine
    prompts = [[1, 4, 5, 6, 3], [1, 9, 8, 7, 3]]
    rng = torch.get_rng_state()
    a = engine.generate(prompts, SamplingParams(max_new_tokens=4, n=3, seed=5))
    assert torch.equal(rng, torch.get_rng_state())  # engines never touch the global RNG (exact resume needs it)
    b = engine.generate(prompts, SamplingParams(max_new_tokens=4, n=3, seed=5))
    c = engine.generate(prompts, SamplingParams(max_new_tokens=4, n=3, seed=6))
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.tokens for r in a] != [r.tokens for r in c]
    assert [r.prompt_index for r in a] == [0, 0, 0, 1, 1, 1]
    tokens = torch.tensor([r.prompt + r.tokens for r in a])
    train_logp = learner.logprobs(tokens)[:, len(prompts[0]) - 1:]
    gap = (train_logp - torch.tensor([r.logprobs for r in a])).abs().max().item()
    # Same layers, same weights, NVFP4 with per-row activation scales (batch invariant): measured 0.0 on
    # 2026-11-29 for equal-length prompts. Megatron's decode attention reads the KV cache in the order the
    # full forward does here; if this ever differs, it is a real train/rollout mismatch to investigate.
    assert gap == 0.0


def test_failed_weight_update_raises_and_keeps_old_weights(learner_and_engine):
    learner, engine = learner_and_engine
    before = {n: t.clone() for n, t in engine.named_weights()}
    good = [(n, t.clone()) for n, t in learner.named_weights()]
    bad_shape = [(n, t[:1] if i == len(good) - 1 else t + 1) for i, (n, t) in enumerate(good)]
    with_nan = [(n, torch.full_like(t, float("nan")) if i == len(good) - 1 else t + 1) for i, (n, t) in enumerate(good)]
    for bad, msg in [(bad_shape, "has shape"), (with_nan, "not a finite"), (good[:-1], "incomplete"),
                     (good + [("decoder.nope.weight", good[0][1])], "unknown weight")]:
        with pytest.raises(WeightUpdateError, match=msg):
            engine.update_weights(bad)
        for n, t in engine.named_weights():
            assert torch.equal(t, before[n]), n


@pytest.mark.slow
def test_resume_with_the_real_learner_is_bitwise(tmp_path):
    base = {"precision.mode": "nvfp4", "rl.minibatches": 2}
    straight = train(_cfg(tmp_path / "a", **base, **{"rl.steps": 3}))
    ck = {"checkpoint.dir": str(tmp_path / "ck")}
    train(_cfg(tmp_path / "b", **base, **ck, **{"rl.steps": 1}))
    torch.manual_seed(999)
    resumed = train(_cfg(tmp_path / "c", **base, **ck, **{"rl.steps": 3}))
    assert [h["step"] for h in resumed] == [2, 3]
    for key in ("loss", "loss/policy", "reward/mean", "grad_norm", "mismatch/logp_abs_mean"):
        assert [h[key] for h in straight[1:]] == [h[key] for h in resumed], key


def test_bad_config_key_is_named(tmp_path, capsys):
    from minite.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  stepz: 3\n")
    assert main(["train", str(bad)]) == 2
    out = capsys.readouterr()
    assert "stepz" in out.out + out.err and "bad.yaml" in out.out + out.err


def test_bad_checkpoint_is_named(tmp_path):
    broken = tmp_path / "step_000001"
    broken.mkdir()
    (broken / "state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="step_000001 has no manifest.json: it is incomplete"):
        train(_cfg(tmp_path, **{"checkpoint.resume_from": str(broken)}))
    with pytest.raises(ckpt.CheckpointError, match="checkpoint not found: .*missing"):
        train(_cfg(tmp_path, **{"checkpoint.resume_from": str(tmp_path / "missing")}))


def test_sglang_backend_dispatches_to_the_sglang_engine(tmp_path, monkeypatch):
    """rollout.backend=sglang builds the SGLang engine (stubbed here: tests/rollout/sglang starts the real one)."""
    import minite.rollout.sglang.engine as sglang_engine

    calls = []
    monkeypatch.setattr(sglang_engine, "build_sglang", lambda cfg, pad_id=0: calls.append((cfg, pad_id)) or "engine")
    assert make_engine(_cfg(tmp_path, **{"rollout.backend": "sglang"})) == "engine"
    assert calls and calls[0][0].rollout.backend == "sglang"


def test_mismatch_metric_sees_a_precision_gap(learner_and_engine):
    """An NVFP4 learner scored against a BF16 engine holding the same weights: the gap must show.

    Measured on 2026-11-29 with examples/tiny/nvfp4.yaml at init: mean |dlogp| 1.7e-2, max 6.5e-2, K3 2.4e-4.
    """
    from minite.rl.metrics import mismatch_metrics

    learner, _ = learner_and_engine
    bf16 = make_engine(load_config(None, ["precision.mode=bf16", "model.max_position_embeddings=16"]))
    bf16.update_weights(learner.named_weights())
    res = bf16.generate([[1, 4, 5, 6, 3], [1, 9, 8, 7, 3]], SamplingParams(max_new_tokens=4, n=4, seed=1))
    tokens = torch.tensor([r.prompt + r.tokens for r in res])
    train_logp = learner.logprobs(tokens)
    rollout_logp, mask = torch.zeros_like(train_logp), torch.zeros_like(train_logp)
    rollout_logp[:, 4:] = torch.tensor([r.logprobs for r in res])
    mask[:, 4:] = 1
    m = mismatch_metrics(train_logp, rollout_logp, mask)
    assert m["mismatch/logp_abs_max"] >= m["mismatch/logp_abs_mean"] > 0 and m["mismatch/k3_kl"] > 0


def test_weight_update_requantises_eagerly_with_the_lazy_bits(learner_and_engine):
    """update_weights fills every NVFP4 weight cache (the sync pays the re-quantisation, the rollout does not): the
    next generate uses those very caches (no second quantisation), and their bits are the lazy path's."""
    from minite.megatron_patches.nvfp4_layers import release_weight_caches

    _, engine = learner_and_engine
    engine.update_weights([(n, t.detach().clone()) for n, t in engine.named_weights()])

    def caches():
        return {(id(m), k): v for m in engine.model.modules() for k, v in vars(m).items()
                if k.startswith("_nvfp4_wq_cache_")}

    eager = caches()
    assert len(eager) >= 3 * 2, "expected the experts' fc1/fc2 and the linears of every layer to be cached"
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
    assert all(caches()[k] is v for k, v in eager.items())  # the forward hit the eager caches
    release_weight_caches(engine.model)  # now the lazy path alone
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
    lazy = caches()
    assert lazy.keys() == eager.keys()
    for key, (_, q) in eager.items():
        a, b = (torch.cat([t.reshape(-1).view(torch.uint8) for t in _tensors(x)]) for x in (q, lazy[key][1]))
        assert torch.equal(a, b), key


def _tensors(q):
    """The tensors of a quantised weight (an NVFP4 tensor object, a tuple of them, or a tensor)."""
    if torch.is_tensor(q):
        return [q.contiguous()]
    if isinstance(q, (tuple, list)):
        return [t for x in q for t in _tensors(x)]
    return [t.contiguous() for t in vars(q).values() if torch.is_tensor(t)]


def _micro_run(tmp_path, micro_batches, warmup_steps=0):
    """`minite train`'s setup (warm-up included) for a BF16 run with rl.minibatches=2 and the given micro-batches."""
    from minite.rl.loop import setup

    cfg = _cfg(tmp_path / f"{micro_batches}-{warmup_steps}", **{
        "rl.steps": 1, "rl.warmup_steps": warmup_steps, "rl.minibatches": 2, "rl.micro_batches": micro_batches,
        "rl.kl_coef": 0.05, "precision.mode": "bf16"})
    return setup(cfg)


def _one_train_step(tmp_path, micro_batches):
    """train_on_batch of the loop on a fixed batch (task prompts, random responses, advantages that are not zero);
    the step's metrics and the weights after it."""
    from minite.rl.loop import make_batch, train_on_batch
    from minite.rollout import RolloutResult

    run = _micro_run(tmp_path, micro_batches)
    g = torch.Generator().manual_seed(0)
    problems = [p for p in run.stream.next_batch() for _ in range(run.cfg.rollout.group_size)]
    rows = [RolloutResult(prompt_index=i, prompt=p.prompt, logprobs=[-1.0] * 4,
                          tokens=torch.randint(1, run.task.tokenizer.vocab_size, (4,), generator=g).tolist())
            for i, p in enumerate(problems)]
    metrics = train_on_batch(run, make_batch(rows), torch.randn(len(rows), generator=g))
    return metrics, {n: w.float().clone() for n, w in run.learner.named_weights()}


def _close_and_moving(one: dict, two: dict, keys) -> None:
    rtol = TOLERANCES["micro_batches_vs_whole_bf16_step"][1]
    for key in keys:
        assert abs(one[key]) > 1e3 * FP32_EPS, (key, one[key])  # a value that a wrong share would change
        assert math.isclose(one[key], two[key], rel_tol=rtol), (key, one[key], two[key])


def test_micro_batches_split_the_forward_not_the_update(tmp_path):
    """rl.micro_batches=2: each minibatch goes through the learner in two chunks and one optimizer step; the step's
    loss, KL and gradient norm are those of the whole minibatch (BF16, whose rounding draws nothing per chunk: the
    tolerance names what differs). The weights after it are compared as a smoke check only (Adam's first steps
    hardly see a gradient's scale)."""
    (one, w_one), (two, w_two) = _one_train_step(tmp_path, 1), _one_train_step(tmp_path, 2)
    _close_and_moving(one, two, ("loss/policy", "kl/ref", "grad_norm", "loss"))
    apart = max((w_one[n] - w_two[n]).abs().max().item() for n in w_one)
    assert apart <= TOLERANCES["micro_batches_vs_whole_bf16_weights"][0], apart


def test_micro_batches_in_the_warmup(tmp_path):
    """The supervised warm-up accumulates the same way: its loss and gradient norm are the whole batch's."""
    logs = []
    for n in (1, 2):
        run = _micro_run(tmp_path, n, warmup_steps=1)
        logs.append(json.loads((Path(run.cfg.logging.dir) / "warmup.jsonl").read_text().splitlines()[0]))
    _close_and_moving(*logs, ("warmup/nll", "warmup/loss", "warmup/grad_norm"))


def test_micro_batches_must_divide_the_rows():
    from minite.rl.loop import check_shapes
    from minite.rl.tasks import make_task

    task = make_task("reverse", length=3, num_digits=10)
    bad = load_config(None, [f"{k}={v}" for k, v in {**TINY, "rl.minibatches": 2, "rl.micro_batches": 3}.items()])
    with pytest.raises(ValueError, match=r"rl.micro_batches=3 does not divide the rows of a train step \(8 rollouts, "
                                         r"minibatches of 4\)"):
        check_shapes(bad, task)
    replay = load_config(None, [f"{k}={v}" for k, v in {**TINY, "rl.micro_batches": 2,
                                                        "alignment.routing_replay": True}.items()])
    with pytest.raises(ValueError, match="does not combine with alignment.routing_replay"):
        check_shapes(replay, task)
    check_shapes(load_config(None, [f"{k}={v}" for k, v in {**TINY, "rl.micro_batches": 4}.items()]), task)
    chunks_of_one = load_config(None, [f"{k}={v}" for k, v in {**TINY, "rl.minibatches": 2,
                                                               "rl.micro_batches": 4}.items()])
    check_shapes(chunks_of_one, task, world_size=1)
    with pytest.raises(ValueError, match=r"the learner's forwards \(1 / 8 rows: .*\) must be multiples of the 2 "
                                         r"data-parallel ranks"):
        check_shapes(chunks_of_one, task, world_size=2)


def test_a_checkpoint_out_of_memory_says_so(tmp_path):
    """A failed allocation while the checkpoint is taken (its copy of the model and optimizer state) names the
    checkpoint and its fix, also inside the RL step's own stop_cleanly (the H200 example's final checkpoint ran an
    80 GB GPU out of memory, reported as the step's rows)."""
    from types import SimpleNamespace

    from minite.rl.failures import OutOfMemoryRunError, stop_cleanly
    from minite.rl.loop import maybe_checkpoint

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}", "rl.steps=3"])

    def state_dict():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 34359738368 bytes.")

    run = SimpleNamespace(cfg=cfg, step=3, learner=SimpleNamespace(state_dict=state_dict), ref=None)
    with pytest.raises(OutOfMemoryRunError, match=r"^out of memory saving the checkpoint of step 3 \(an allocation of "
                                                  r"32\.0 GiB on the CPU\): taking the checkpoint \(a copy"):
        with stop_cleanly(cfg, "at RL step 3 of 3"):
            maybe_checkpoint(run)
    run.step = 2  # not a step that saves: nothing is taken
    maybe_checkpoint(run)


def test_failures_the_user_fixes_become_their_one_line_errors(tmp_path):
    """stop_cleanly: NaN or Inf -> DivergedError, a failed allocation (CUDA's or the CPU allocator's) ->
    OutOfMemoryRunError with the size asked for; anything else passes through unchanged."""
    from minite.nvfp4 import NonFiniteError
    from minite.rl.failures import MODEL_TOO_BIG, DivergedError, OutOfMemoryRunError, stop_cleanly

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}", f"logging.dir={tmp_path}"])
    with pytest.raises(DivergedError, match=r"^the run diverged at RL step 4 of 9: quantize input contains NaN or "
                                            r"Inf\. Lower optim.lr .* again: it starts over$"):
        with stop_cleanly(cfg, "at RL step 4 of 9"):
            raise NonFiniteError("quantize input contains NaN or Inf")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "139.81 GiB of which 1.20 GiB is free.")
    with pytest.raises(OutOfMemoryRunError, match=r"^out of memory at RL step 2 of 9 \(an allocation of 2\.00 GiB on "
                                                  r"the GPU\): a step's rows do not fit: lower rl.prompts_per_step"):
        with stop_cleanly(cfg, "at RL step 2 of 9"):
            raise cuda
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    with pytest.raises(OutOfMemoryRunError, match=r"^out of memory while building the run \(an allocation of 64\.0 "
                                                  r"GiB on the CPU\): the model does not fit: shrink it"):
        with stop_cleanly(cfg, "while building the run", memory_fix=MODEL_TOO_BIG):
            raise cpu
    for other in (RuntimeError("shape mismatch"), ValueError("bad value"), KeyError("x")):
        with pytest.raises(type(other)) as caught:
            with stop_cleanly(cfg, "at RL step 1 of 9"):
                raise other
        assert caught.value is other
