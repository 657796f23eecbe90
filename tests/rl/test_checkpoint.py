"""Checkpoints: atomic save under a real kill, clear errors, and bitwise resume of the RL loop.

The loop runs here over a tiny stand-in policy (a causal bag-of-embeddings LM with Adam and a
KV-cache-free sampler) so the test exercises the loop's own state (RNG, prompt stream, step,
reference policy, optimizer) in seconds; tests/rl/test_rl_step.py runs the real Learner.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl import loop
from minite.rollout.base import RolloutEngine, RolloutResult, checked_weight_copy, truncate_at_stop


class TinyLM(torch.nn.Module):
    """logits_t = W [emb(x_t) + pos(t) + mean(emb(x_<=t))]: causal, deterministic, fast."""

    def __init__(self, vocab: int, dim: int = 32, max_len: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def logprobs(self, tokens):
        e = self.emb(tokens)
        mean = e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]
        h = torch.tanh(e + self.pos(torch.arange(tokens.shape[1]))[None] + mean)
        lp = torch.log_softmax(self.out(h)[:, :-1].float(), -1)
        return lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


class StandInLearner:
    def __init__(self, cfg):
        self.model = TinyLM(cfg.model.vocab_size)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.optim.lr)

    def logprobs(self, tokens):
        with torch.no_grad():
            return self.model.logprobs(tokens)

    def train_step(self, tokens, loss_fn, micro_batches=1):
        assert micro_batches == 1  # the stand-in has no gradient accumulation
        self.opt.zero_grad()
        loss, metrics = loss_fn(self.model.logprobs(tokens))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return {"loss": loss.item(), **metrics}

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def named_weights(self):
        return list(self.model.named_parameters())

    def load_weights(self, named):  # as the KL reference policy (minite.learner.learner.ReferencePolicy)
        with torch.no_grad():
            checked_weight_copy(dict(self.model.named_parameters()), named)


class StandInEngine(RolloutEngine):
    def __init__(self, cfg):
        self.model = TinyLM(cfg.model.vocab_size).requires_grad_(False)
        self.params = dict(self.model.named_parameters())

    def generate(self, prompts, params):
        g = torch.Generator().manual_seed(params.seed)
        out = []
        for i, p in enumerate(prompts):
            for _ in range(params.n):
                toks, lps = list(p), []
                for _ in range(params.max_new_tokens):
                    lp_all = torch.log_softmax(self.model.out(self._h(toks)), -1)
                    t = int(torch.multinomial((lp_all / params.temperature).softmax(-1), 1, generator=g))
                    toks.append(t)
                    lps.append(lp_all[t].item())
                r, l, fin = truncate_at_stop(toks[len(p):], lps, params.stop_token_id)
                out.append(RolloutResult(prompt_index=i, prompt=list(p), tokens=r, logprobs=l, finished=fin))
        return out

    def _h(self, toks):
        x = torch.tensor(toks)
        e = self.model.emb(x)
        return torch.tanh(e[-1] + self.model.pos(torch.tensor(len(toks) - 1)) + e.mean(0))

    def update_weights(self, named_tensors):
        checked_weight_copy(self.params, named_tensors)

    def logprobs(self, tokens):
        return self.model.logprobs(tokens)

    def named_weights(self):
        return list(self.params.items())


def _cfg(tmp_path, steps, **extra):
    sets = {"rl.steps": steps, "rl.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 5,
            "rl.task_length": 3, "rl.task_digits": 5, "rl.minibatches": 2, "rl.kl_coef": 0.1,
            "rl.warmup_steps": 2, "rl.is_correction": "tis", "optim.lr": 0.01,
            "logging.dir": str(tmp_path / "logs"), "logging.tensorboard": False, "logging.progress_bar": False,
            **extra}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _train(cfg):
    run = loop.setup(cfg, learner_factory=StandInLearner, engine_factory=StandInEngine,
                     reference_factory=StandInLearner)
    while run.step < cfg.rl.steps:
        loop.rl_step(run)
    return run


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    straight = _train(_cfg(tmp_path / "a", 4))
    _train(_cfg(tmp_path / "b", 2, **{"checkpoint.dir": str(tmp_path / "ck")}))
    torch.manual_seed(12345)  # the resumed process starts from unrelated global RNG state
    resumed = _train(_cfg(tmp_path / "c", 4, **{"checkpoint.dir": str(tmp_path / "ck")}))
    assert [h["step"] for h in resumed.history] == [3, 4]
    for key in ("loss/policy", "reward/mean", "mismatch/logp_abs_mean", "kl/ref", "loss"):
        assert [h[key] for h in straight.history[2:]] == [h[key] for h in resumed.history], key
    for (n, a), (_, b) in zip(straight.learner.named_weights(), resumed.learner.named_weights()):
        assert torch.equal(a, b), n
    assert ckpt.latest_checkpoint(tmp_path / "ck").name == "step_000004"


_KILLER = textwrap.dedent("""
    import os, sys, torch
    from minite.rl import checkpoint as ckpt
    root, where = sys.argv[1], sys.argv[2]
    real_save, real_rename = torch.save, os.rename
    def dying_save(obj, f):
        f.write(b"PK-partial")  # a few bytes hit the disk, then the process dies
        f.flush()
        os._exit(137)
    def dying_rename(a, b):
        os._exit(137)
    if where == "write":
        torch.save = dying_save
    else:
        os.rename = dying_rename
    ckpt.save_checkpoint(root, 2, {"learner": {"w": torch.full((3,), 2.0)}, "rng": {}, "data": {}})
""")


@pytest.mark.parametrize("where", ["write", "commit"])
def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path, where):
    root = tmp_path / "ck"
    ckpt.save_checkpoint(root, 1, {"learner": {"w": torch.ones(3)}, "rng": {}, "data": {}})
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(root), where], capture_output=True)
    assert proc.returncode == 137, proc.stderr.decode()
    assert any(p.name.startswith(".tmp-") for p in root.iterdir())  # the half-written save is there ...
    latest = ckpt.latest_checkpoint(root)
    assert latest.name == "step_000001"  # ... but ignored
    assert torch.equal(ckpt.load_checkpoint(latest)["learner"]["w"], torch.ones(3))
    ckpt.save_checkpoint(root, 3, {"learner": {"w": torch.zeros(3)}, "rng": {}, "data": {}})
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert ckpt.latest_checkpoint(root).name == "step_000003"


def test_keep_prunes_old_checkpoints(tmp_path):
    for s in range(1, 5):
        ckpt.save_checkpoint(tmp_path, s, {"learner": {}, "rng": {}, "data": {}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_corrupt_and_missing_checkpoints_name_the_file(tmp_path):
    d = ckpt.save_checkpoint(tmp_path, 1, {"learner": {}, "rng": {}, "data": {}})
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and [s["file"] for s in manifest["shards"]] == ["state.pt"]
    data = bytearray((d / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte that torch.load alone might not notice
    (d / "state.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"step_000001/state.pt is corrupt \(its sha256 differs"):
        ckpt.load_checkpoint(d)
    with pytest.raises(ckpt.CheckpointError, match="checkpoint not found: .*nowhere"):
        ckpt.load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="checkpoint file not found: .*empty/state.pt"):
        ckpt.load_checkpoint(tmp_path / "empty")
    (tmp_path / "bare").mkdir()
    torch.save({"hello": 1}, tmp_path / "bare" / "state.pt")
    with pytest.raises(ckpt.CheckpointError, match="bare has no manifest.json: it is incomplete"):
        ckpt.load_checkpoint(tmp_path / "bare" / "state.pt")


def test_rng_capture_restore_round_trip():
    import random

    state = ckpt.capture_rng()
    a = (torch.rand(3), random.random())
    ckpt.restore_rng(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
