"""A Ctrl-C is never lost (minite.console.catch_interrupts): a KeyboardInterrupt raised inside a bare `except:` or a
destructor vanishes, and the run went on to its end (`test_ctrl_c_is_one_line_and_status_130` once exited 0 on a
loaded machine). The handler remembers the signal, and the RL loop stops at its next step."""
import os
import signal
import time

import pytest

import minite.console as console
from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl.loop import train


@pytest.fixture
def sigint_handler():
    old = signal.getsignal(signal.SIGINT)
    console.catch_interrupts()
    yield
    signal.signal(signal.SIGINT, old)
    console._interrupted = False


def test_a_ctrl_c_that_a_bare_except_swallowed_is_remembered(sigint_handler):
    console.raise_if_interrupted()  # nothing pressed yet: no-op
    raised = False
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(200):  # the handler runs between bytecodes, at the latest within this loop
            time.sleep(0.005)
    except:  # noqa: E722 - what Megatron-Core's optional imports do
        raised = True
    assert raised, "the SIGINT handler did not raise KeyboardInterrupt"
    with pytest.raises(KeyboardInterrupt):
        console.raise_if_interrupted()


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_the_rl_loop_stops_at_its_next_step_after_a_swallowed_ctrl_c(monkeypatch, tmp_path, warmup_steps):
    monkeypatch.setattr(console, "_interrupted", True)  # as if pressed during start-up and swallowed there
    sets = {"rl.prompts_per_step": 2, "rollout.group_size": 2, "rl.steps": 2, "rl.warmup_steps": warmup_steps,
            "model.max_position_embeddings": 16, "logging.progress_bar": False, "logging.dir": str(tmp_path / "run"),
            "checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1}
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, [f"{k}={v}" for k, v in sets.items()]))
    assert ckpt.latest_checkpoint(tmp_path / "ck") is None  # stopped before any step ran
