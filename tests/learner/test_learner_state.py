"""Learner interface: log-prob semantics, exact resume from state_dict, weight sync via named_weights, clear errors."""
import pytest
import torch

from minite.config import load_config
from tests.tolerances import TOLERANCES

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.vocab_size=48", "model.num_experts=4",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=16", "model.head_dim=8", "rl.seed=11",
        "optim.lr=3e-3"]


def cfg(*overrides):
    return load_config(None, TINY + list(overrides))


def loss_fn(logp):
    loss = -logp.mean()
    return loss, {"nll": float(loss.detach())}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 48, (3, 17), generator=torch.Generator().manual_seed(1))


def test_logprobs_are_next_token_log_softmax(tokens):
    from minite.learner.learner import Learner
    learner = Learner(cfg("precision.mode=bf16"))
    lp = learner.logprobs(tokens)
    assert lp.shape == (3, 16) and lp.dtype == torch.float32 and not lp.requires_grad
    pos = torch.arange(17).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = learner.model(tokens, pos, None).float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.equal(lp, want)
    with pytest.raises(ValueError, match="LongTensor"):
        learner.logprobs(tokens.float())
    with pytest.raises(ValueError, match="at least 2"):
        learner.logprobs(tokens[:, :1])


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_train_forward_equals_logprobs(tokens, precision):
    """On-policy: the log-probs train_step hands to loss_fn equal learner.logprobs bitwise (PPO ratio exactly 1)."""
    from minite.learner.learner import Learner
    learner = Learner(cfg(f"precision.mode={precision}"))
    before = learner.logprobs(tokens)
    seen = {}

    def capture(logp):
        seen["logp"] = logp.detach().clone()
        return loss_fn(logp)

    learner.train_step(tokens, capture)
    assert torch.equal(seen["logp"], before)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_resume_is_exact(tokens, precision):
    """2 steps, snapshot, 2 more == a fresh learner loading the snapshot, then 2 steps (bitwise)."""
    from minite.learner.learner import Learner
    a = Learner(cfg(f"precision.mode={precision}"))
    for _ in range(2):
        a.train_step(tokens, loss_fn)
    snap = a.state_dict()
    metrics_a = [a.train_step(tokens, loss_fn) for _ in range(2)]
    b = Learner(cfg(f"precision.mode={precision}"))
    b.load_state_dict(snap)
    metrics_b = [b.train_step(tokens, loss_fn) for _ in range(2)]
    assert metrics_a == metrics_b
    assert torch.equal(a.logprobs(tokens), b.logprobs(tokens))
    assert b.step == 4 and (b.nvfp4 is None or b.nvfp4.step == 4)


def test_named_weights_sync_a_fresh_model(tokens):
    """Copying named_weights into build_model(cfg) reproduces the learner's log-probs exactly (rollout sync)."""
    from minite.learner.learner import Learner, token_logprobs
    from minite.learner.model import build_model
    c = cfg("precision.mode=nvfp4")
    learner = Learner(c)
    learner.train_step(tokens, loss_fn)
    engine_model = build_model(c, strict=False)
    params = dict(engine_model.named_parameters())
    weights = dict(learner.named_weights())
    assert weights.keys() == params.keys()
    with torch.no_grad():
        for name, t in weights.items():
            params[name].copy_(t)
        engine_model.eval()
        pos = torch.arange(17).unsqueeze(0).expand_as(tokens)
        lp = token_logprobs(engine_model(tokens, pos, None), tokens)
    assert torch.equal(lp, learner.logprobs(tokens))


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_load_weights_reaches_the_optimizers_masters(tokens, precision):
    """Weights loaded into a learner that trains are what its next step starts from: with lr = 1e-30 (an update
    below every weight's rounding) the step leaves the loaded weights in place (Megatron's optimizer writes its fp32
    masters into the weights; without a refresh of the masters the learner would return to its own old weights)."""
    from minite.learner.learner import Learner
    other = Learner(cfg(f"precision.mode={precision}", "rl.seed=9"))
    loaded = {n: t.clone() for n, t in other.named_weights()}
    other.close()
    learner = Learner(cfg(f"precision.mode={precision}", "optim.lr=1e-30", "optim.weight_decay=0.0"))
    assert any(not torch.equal(p.detach(), loaded[n]) for n, p in learner.model.named_parameters())
    learner.load_weights(loaded.items())
    learner.train_step(tokens, loss_fn)
    for name, p in learner.model.named_parameters():
        assert torch.equal(p.detach(), loaded[name]), name
    learner.close()


def test_bad_state_dicts_raise(tokens):
    from minite.learner.learner import Learner
    learner = Learner(cfg("precision.mode=bf16"))
    with pytest.raises(ValueError, match="missing"):
        learner.load_state_dict({"model": {}})
    sd = learner.state_dict()
    with pytest.raises(ValueError, match="precision"):
        learner.load_state_dict({**sd, "precision": "nvfp4"})
    bad = {**sd, "model": {k: v for k, v in sd["model"].items() if "router" not in k}}
    with pytest.raises(ValueError, match="does not match the model"):
        learner.load_state_dict(bad)
    with pytest.raises(ValueError, match="scalar loss"):
        learner.train_step(tokens, lambda logp: (logp, {}))


def test_bad_precision_config_raises():
    with pytest.raises(ValueError, match="params_dtype"):  # refused when the config loads
        cfg("precision.params_dtype=bfloat16")
    with pytest.raises(ValueError, match="pp=2: pipeline parallelism is not supported"):  # when the config loads
        cfg("parallel.pp=2")


def _adam_groups(learner):
    return [g for o in learner.optimizer.chained_optimizers for g in o.optimizer.param_groups]


def test_adam_on_cpu_is_torchs_default_even_after_loading_a_fused_state(tokens):
    """CPU behaviour is Megatron's as built (torch's single-tensor AdamW); a checkpoint whose groups say fused (saved
    on a GPU) does not switch a CPU learner to another implementation."""
    from minite.learner.learner import Learner
    a = Learner(cfg("precision.mode=bf16"))
    assert all(g["fused"] is None and g["foreach"] is None for g in _adam_groups(a))
    a.train_step(tokens, loss_fn)
    snap = a.state_dict()
    groups = [g for o in snap["optimizer"] for g in o["optimizer"]["param_groups"]]  # one per chained optimizer
    assert groups
    for g in groups:
        g.update(fused=True, foreach=False)
    b = Learner(cfg("precision.mode=bf16"))
    b.load_state_dict(snap)
    assert all(g["fused"] is None and g["foreach"] is None for g in _adam_groups(b))


def test_micro_batches_accumulate_to_the_whole_batch_step(tokens):
    """Gradient accumulation: 3 rows as 3 micro-batches of 1 (each loss its share of the token mean) take the same
    Adam step as the whole batch at once, up to the order of fp32 sums; loss_fn sees each chunk once; the reported
    loss is the sum of the chunks' and metrics are their mean; rows that do not split are refused."""
    from minite.learner.learner import Learner
    c = cfg("precision.mode=bf16", "precision.compute_dtype=float32")
    n = tokens.shape[0] * (tokens.shape[1] - 1)
    whole, acc = Learner(c), Learner(c)
    m1 = whole.train_step(tokens, lambda lp: (-lp.sum() / n, {"rows": float(lp.shape[0])}))
    seen = []

    def share(lp):
        seen.append(lp.shape[0])
        return -lp.sum() / n, {"rows": float(lp.shape[0])}

    m3 = acc.train_step(tokens, share, micro_batches=3)
    assert seen == [1, 1, 1] and m3["rows"] == 1.0 and m1["rows"] == 3.0
    atol, rtol = TOLERANCES["learner_micro_batches_fp32"]
    assert abs(m3["loss"] - m1["loss"]) <= rtol * abs(m1["loss"])
    assert abs(m3["grad_norm"] - m1["grad_norm"]) <= rtol * m1["grad_norm"]
    gap = max((a - b).abs().max().item() for (_, a), (_, b) in zip(whole.named_weights(), acc.named_weights()))
    assert gap <= atol
    with pytest.raises(ValueError, match="micro_batches"):
        acc.train_step(tokens, share, micro_batches=2)


@pytest.mark.parametrize("micro", [1, 3])
def test_first_wgrad_of_a_step_writes_main_grad_to_the_same_bits(tokens, micro, monkeypatch):
    """The Learner marks its main_grads zeroed at each step's start (`mark_main_grads_zeroed`) so the first expert wgrad
    of a step writes main_grad unread. On the kernels (the interpreter here) two steps give the same losses, grad
    norms and weights, bit for bit, as with the marks off; the first wgrad of each expert weight and step is the one
    told so (at once with one micro-batch; the first flush of DeferredWgrads with three), and no mark outlives the
    step."""
    import minite.learner.learner as L
    import minite.ops.grouped as G
    told = []

    def spy(real):
        def call(*a, **k):
            told.append(k.get("zeroed", False))
            return real(*a, **k)
        return call

    for name in ("segmented_gemm", "segmented_gemm_passes"):
        monkeypatch.setattr(G, name, spy(getattr(G, name)))
    runs = []
    for marks in (True, False):
        if not marks:
            monkeypatch.setattr(L, "mark_main_grads_zeroed", lambda params, zeroed=True: None)
        told.clear()
        learner = L.Learner(cfg("precision.mode=nvfp4"))
        learner.nvfp4.backend = "triton"
        out = [learner.train_step(tokens, lambda lp: (-lp.mean() / micro, {}), micro_batches=micro) for _ in range(2)]
        assert not any(getattr(p, G.MAIN_GRAD_ZEROED, False) for p in learner.model.parameters())
        runs.append((out, [w.clone() for _, w in learner.named_weights()], list(told)))
        learner.close()
    (out_on, w_on, told_on), (out_off, w_off, told_off) = runs
    # per step: fc1 and fc2 of the one layer; with 3 micro-batches and 2 passes a launch, 2 flushes per weight
    first = [True, True] if micro == 1 else [True, True, False, False]
    assert told_on == first * 2 and not any(told_off)
    assert out_on == out_off
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else
               torch.equal(a, b) for a, b in zip(w_on, w_off))


def test_the_moe_dgrads_take_their_amax_from_the_pass_before(tokens, monkeypatch):
    """The Learner's MoE layer hands both dgrad operands their amax (`minite.ops.common.hint_amax`): FC2's from the
    combine's backward, FC1's from the experts' SwiGLU backward (on the kernels: the interpreter here, routed as on a
    GPU). With the hints off the step's losses and weights are bitwise the same."""
    import minite.learner.learner as L
    from minite.nvfp4 import recipe as recipe_module
    from minite.ops import common
    from minite.strict import fused

    monkeypatch.setattr(fused, "_gpu", lambda x: True)  # the SwiGLU's kernels route as on a GPU (CPU tensors here)
    given = []
    real = recipe_module.quantize
    monkeypatch.setattr(recipe_module, "quantize", lambda *a, **k: given.append(k.get("global_amax")) or real(*a, **k))
    runs = []
    for hints in (True, False):
        if not hints:
            monkeypatch.setattr(common, "hinted_amax", lambda t: None)
            monkeypatch.setattr("minite.ops.grouped.hinted_amax", lambda t: None)
        given.clear()
        learner = L.Learner(cfg("precision.mode=nvfp4"))
        out = learner.train_step(tokens, loss_fn)
        runs.append((out, [w.clone() for _, w in learner.named_weights()], sum(a is not None for a in given)))
        learner.close()
    (out_on, w_on, n_on), (out_off, w_off, n_off) = runs
    assert n_on == 2 and n_off == 0  # one layer: FC2's dgrad and FC1's
    assert out_on == out_off and all(torch.equal(a, b) for a, b in zip(w_on, w_off))


def test_no_grad_default_logprobs_take_the_samplers_lse(monkeypatch):
    """token_logprobs without a gradient, where the sampler's log-sum-exp applies (a GPU with the kernel proven;
    here forced on the CPU, the kernel interpreted): logit - row_logsumexp, the rollout's bits for the same logits
    (tests/rollout/test_sampling.py), within "lse_fused" of torch's log_softmax; under autograd torch's log_softmax."""
    from minite.learner import learner as learner_mod
    from minite.ops.logprobs import row_logsumexp
    from tests.tolerances import TOLERANCES

    learner = learner_mod.Learner(cfg("precision.mode=bf16"))  # Megatron's parallel state (TP = 1)
    dev = next(learner.model.parameters()).device  # the kernel runs compiled on a GPU, interpreted on the CPU
    learner.close()
    g = torch.Generator().manual_seed(2)
    logits, toks = torch.randn(2, 9, 5000, generator=g) * 3, torch.randint(0, 5000, (2, 9), generator=g)
    logits, toks = logits.to(dev), toks.to(dev)
    torch_lp = learner_mod.token_logprobs(logits, toks)
    monkeypatch.setattr(learner_mod, "lse_applies", lambda x: True)
    flat = logits[:, :-1].reshape(-1, 5000)
    want = (flat.gather(1, toks[:, 1:].reshape(-1, 1)).view(-1) - row_logsumexp(flat)).view(2, 8)
    got = learner_mod.token_logprobs(logits, toks)
    assert torch.equal(got, want) and not torch.equal(got, torch_lp)  # the kernel's sums, not torch's
    atol, rtol = TOLERANCES["lse_fused"]
    assert bool(((got - torch_lp).abs() <= atol + rtol * (torch_lp.abs() + 20)).all())  # |logits| < 20 here
    assert torch.equal(learner_mod.token_logprobs(logits.clone().requires_grad_(), toks), torch_lp)
