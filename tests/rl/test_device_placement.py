"""The RL loop's tensors meet the learner's on the learner's device: on a GPU the learner's log-probs live on cuda:0
while the loop builds its batch on the host, and an op mixing the two raises. No GPU here: the learner's log-probs
are FakeTensors on a fake cuda:0 (torch's FakeTensorMode checks device propagation as CUDA does and raises the same
"Expected all tensors to be on the same device" error), while the loop builds its batch on the host as it does on a
real machine."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from minite.rl import loop
from minite.rl.grpo import GRPOParams, grpo_loss
from minite.rl.tasks import PromptStream, make_task
from tests.rl.test_checkpoint import _cfg


def _mode():
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


@pytest.fixture
def fake_cuda():
    with _mode():
        yield


def test_fake_cuda_catches_a_host_tensor(fake_cuda):
    logp = torch.zeros(2, 3, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        (logp * torch.ones(2, 3)).sum()  # the trap raises what CUDA raises for a host tensor in the loss


def test_grpo_loss_runs_on_the_log_probs_device(fake_cuda):
    logp = torch.zeros(4, 5, device="cuda")
    host = torch.zeros(4, 5)
    loss, _ = grpo_loss(logp, host, torch.ones(4), torch.ones(4, 5), GRPOParams(kl_coef=0.1, is_correction="tis"),
                        rollout_logp=host, ref_logp=host)
    assert loss.device == logp.device


class FakeCudaLearner:
    """Log-probs on fake cuda:0; train_step runs the loop's loss_fn on them and records the loss's device."""

    def __init__(self):
        self.devices, self.mode = [], _mode()

    def logprobs(self, tokens):
        with self.mode:
            return torch.full((tokens.shape[0], tokens.shape[1] - 1), -1.0, device="cuda")

    def local_rows(self, n):
        return range(n)

    def train_step(self, tokens, loss_fn, micro_batches=1):
        assert micro_batches == 1  # the stand-in has no gradient accumulation
        with self.mode:  # the loss_fn's host tensors meet fake cuda:0 here, as they meet cuda:0 on a GPU
            loss, _ = loss_fn(self.logprobs(tokens))
        self.devices.append(loss.device)
        return {"loss": 0.0}


def test_warmup_and_train_losses_run_on_the_learner_device(tmp_path, monkeypatch):
    # the gap monitor compares the (here symbolic) metric values with thresholds: values, not devices
    monkeypatch.setattr(loop, "check_gap", lambda metrics, cfg, step: None)
    cfg = _cfg(tmp_path, 1, **{"rl.kl_coef": 0.0, "rl.warmup_steps": 2})
    task = make_task(cfg.rl.task, length=cfg.rl.task_length, num_digits=cfg.rl.task_digits)
    learner = FakeCudaLearner()
    run = loop.Run(cfg=cfg, learner=learner, engine=None, task=task,
                   stream=PromptStream(task, batch_size=cfg.rl.prompts_per_step, seed=0),
                   grpo=GRPOParams(is_correction="tis"))
    loop.warmup(run)
    problems = run.stream.next_batch()
    rows = [loop.RolloutResult(prompt_index=k // 4, prompt=p.prompt, tokens=p.target, logprobs=[-1.0] * len(p.target))
            for k, p in enumerate(problems * 4)]
    loop.train_on_batch(run, loop.make_batch(rows), torch.zeros(len(rows)))
    assert [d.type for d in learner.devices] == ["cuda"] * (2 + cfg.rl.minibatches)
