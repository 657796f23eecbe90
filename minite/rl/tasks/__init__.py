"""Tasks with verifiable rewards, behind one registry: `make_task(name, ...)` builds the task named by rl.task.

A task gives prompts and scores responses exactly; the RL loop needs from it: `tokenizer` (vocab_size, eos_id),
`prompt_len`, `response_len`, `sample(n, generator) -> [Problem]`, `reward(problem, response) -> float in [0, 1]`.
A new task is a module here that calls `register_task(name, factory)`; factory(length=, num_digits=) builds it.

digits.py   copy / reverse / sort of a digit string, with a tiny tokenizer (the main job's task)
"""
from __future__ import annotations

from typing import Callable

from .digits import BOS, EOS, PAD, SEP, DigitTask, DigitTokenizer, Problem, PromptStream, mix_seed

_REGISTRY: dict[str, Callable[..., DigitTask]] = {}


def register_task(name: str, factory: Callable[..., DigitTask]) -> None:
    """Make `name` a valid rl.task; factory(length=, num_digits=) returns the task."""
    _REGISTRY[name] = factory


def task_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_task(name: str, *, length: int, num_digits: int = 10) -> DigitTask:
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose one of {task_names()}")
    return _REGISTRY[name](length=length, num_digits=num_digits)


for _name in ("copy", "reverse", "sort"):
    register_task(_name, lambda _n=_name, **kw: DigitTask(_n, **kw))

__all__ = ["BOS", "EOS", "PAD", "SEP", "DigitTask", "DigitTokenizer", "Problem", "PromptStream", "mix_seed",
           "make_task", "register_task", "task_names"]
