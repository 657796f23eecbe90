"""Tasks: exact rewards, the tokenizer round trip and the deterministic prompt stream."""
import pytest
import torch

from minite.rl.tasks import BOS, EOS, SEP, DigitTask, PromptStream, make_task


@pytest.mark.parametrize("name,digits,want", [("copy", [3, 1, 2], [3, 1, 2]),
                                              ("reverse", [3, 1, 2], [2, 1, 3]),
                                              ("sort", [3, 1, 2], [1, 2, 3])])
def test_problem_layout(name, digits, want):
    task = make_task(name, length=3)
    p = task.make_problem(digits)
    tok = task.tokenizer
    assert p.prompt == [BOS, *tok.encode_digits(digits), SEP]
    assert p.target == [*tok.encode_digits(want), EOS]
    assert len(p.prompt) == task.prompt_len and len(p.target) == task.response_len
    assert tok.decode(p.target) == " ".join(map(str, want)) + " <eos>"


def test_reward_partial_credit_and_truncation():
    task = make_task("reverse", length=3)
    p = task.make_problem([1, 2, 3])
    t = p.target  # 3 2 1 <eos>
    assert task.reward(p, t) == 1.0
    assert task.reward(p, t + [5, 6]) == 1.0  # nothing after <eos> counts
    assert task.reward(p, [t[0], t[1], EOS]) == 0.5  # 2 of 4 positions
    assert task.reward(p, [EOS]) == 0.0
    assert task.reward(p, t[:3]) == 0.75  # digits right, no <eos>
    assert task.reward(p, [99, 99, 99, 99]) == 0.0  # ids outside the vocabulary score as wrong


def test_stream_is_a_function_of_seed_and_position():
    task = make_task("sort", length=4, num_digits=5)
    a = PromptStream(task, batch_size=6, seed=7)
    batches = [a.next_batch() for _ in range(3)]
    b = PromptStream(task, batch_size=6, seed=7)
    b.next_batch()
    state = b.state_dict()
    c = PromptStream(task, batch_size=6, seed=7)
    c.load_state_dict(state)
    assert c.next_batch() == batches[1] and c.next_batch() == batches[2]
    assert PromptStream(task, batch_size=6, seed=8).next_batch() != batches[0]
    assert all(0 <= d - 4 < 5 for p in batches[0] for d in p.prompt[1:-1])


def test_stream_rejects_foreign_state():
    task = make_task("copy", length=2)
    with pytest.raises(ValueError, match="does not match"):
        PromptStream(task, batch_size=2, seed=0).load_state_dict({"seed": 1, "batch_size": 2, "position": 3})


@pytest.mark.parametrize("kw", [{"name": "add", "length": 3}, {"name": "copy", "length": 0},
                                {"name": "copy", "length": 3, "num_digits": 11}])
def test_bad_task_arguments(kw):
    with pytest.raises(ValueError):
        DigitTask(kw.pop("name"), **kw)


def test_sample_uses_only_the_given_generator():
    task = make_task("copy", length=3)
    before = torch.get_rng_state()
    task.sample(4, torch.Generator().manual_seed(0))
    assert torch.equal(before, torch.get_rng_state())
