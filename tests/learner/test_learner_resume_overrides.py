"""Resume policy in the learner: a loaded optimizer state carries the saving run's param groups; the learner puts the
current cfg.optim into them (minite.rl.resume_policy), so `--set optim.lr=...` on resume takes effect."""
import torch

from minite.config import load_config
from minite.learner.learner import Learner

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.vocab_size=48", "model.num_experts=4",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=16", "model.head_dim=8", "rl.seed=11",
        "precision.mode=bf16"]


def _loss(logp):
    loss = -logp.mean()
    return loss, {}


def test_resumed_learner_takes_the_current_optimizer_settings():
    tokens = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    a = Learner(load_config(None, TINY + ["optim.lr=3e-3"]))
    a.train_step(tokens, _loss)
    snap = a.state_dict()
    b = Learner(load_config(None, TINY + ["optim.lr=1e-2", "optim.weight_decay=0.1", "optim.adam_beta2=0.99"]))
    b.load_state_dict(snap)
    groups = b.optimizer.param_groups
    assert groups and all(g["lr"] == 1e-2 * g.get("lr_mult", 1.0) for g in groups)
    assert all(g["weight_decay"] == 0.1 * g.get("wd_mult", 1.0) and g["betas"] == (0.9, 0.99) for g in groups)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    a.train_step(tokens, _loss)
    b.train_step(tokens, _loss)  # same state, same gradients, other lr: other weights
    assert any(not torch.equal(p.detach(), dict(a.model.named_parameters())[n].detach())
               for n, p in b.model.named_parameters() if not torch.equal(p.detach(), before[n]))
