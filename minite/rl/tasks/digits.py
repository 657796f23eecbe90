"""Verifiable-reward tasks generated in code, with a tiny tokenizer of their own.

Why these tasks: the main job trains a randomly initialised model on two CPU cores in a few
minutes, so the task must be learnable from scratch by a model of ~100k parameters and the
reward must be checkable exactly. Digit-string transformations are:

    prompt   <bos> d1 d2 ... dL =          (L digits drawn uniformly from 0..D-1)
    response t1 t2 ... tL <eos>            (copy: t = d; reverse: t = reversed d; sort: sorted d)

Reward (partial credit, in [0, 1]): the fraction of the L+1 target positions (the L digits and the
final <eos>) that the response gets right, position by position, after truncating the response
at its first <eos>. Partial credit matters for GRPO: with an all-or-nothing reward a random policy
almost never scores, every group has zero variance and the advantages are all zero.

Vocabulary (13 ids, the model may have more; ids it cannot decode score as wrong):
    0 <pad>   1 <bos>   2 <eos>   3 =   4..13 the digits 0..9

The prompt stream is a pure function of (seed, position): batch i is drawn from a generator
seeded with mix_seed(seed, i), so resuming from a checkpoint needs only the position
(`PromptStream.state_dict`) and continues exactly as an uninterrupted run would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4
TASKS = ("copy", "reverse", "sort")


class DigitTokenizer:
    """Maps the task alphabet to ids and back. `eod` is the id Megatron's engine pads with."""

    specials = ("<pad>", "<bos>", "<eos>", "=")
    pad_id, bos_id, eos_id, sep_id = PAD, BOS, EOS, SEP
    eod = EOS
    vocab_size = len(specials) + 10

    def encode_digits(self, digits: list[int]) -> list[int]:
        if any(not 0 <= d <= 9 for d in digits):
            raise ValueError(f"digits must be in 0..9, got {digits}")
        return [DIGIT0 + d for d in digits]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if 0 <= i < len(self.specials):
                out.append(self.specials[i])
            elif DIGIT0 <= i < DIGIT0 + 10:
                out.append(str(i - DIGIT0))
            else:
                out.append("?")
        return " ".join(out)

    def detokenize(self, ids: list[int]) -> str:
        """Megatron's TextGenerationController calls this name."""
        return self.decode(list(ids))


@dataclass(frozen=True)
class Problem:
    """One prompt and the exact response that earns reward 1."""

    prompt: list[int]
    target: list[int]


class DigitTask:
    """copy / reverse / sort of `length` digits drawn from 0..num_digits-1."""

    def __init__(self, name: str, *, length: int, num_digits: int = 10):
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose one of {TASKS}")
        if length < 1:
            raise ValueError(f"task length must be >= 1, got {length}")
        if not 2 <= num_digits <= 10:
            raise ValueError(f"num_digits must be in 2..10, got {num_digits}")
        self.name, self.length, self.num_digits = name, length, num_digits
        self.tokenizer = DigitTokenizer()

    @property
    def prompt_len(self) -> int:
        return self.length + 2

    @property
    def response_len(self) -> int:
        """Tokens in a perfect response (digits + <eos>): the natural max_new_tokens."""
        return self.length + 1

    def solve(self, digits: list[int]) -> list[int]:
        if self.name == "copy":
            return list(digits)
        if self.name == "reverse":
            return digits[::-1]
        return sorted(digits)

    def make_problem(self, digits: list[int]) -> Problem:
        tok = self.tokenizer
        prompt = [BOS, *tok.encode_digits(digits), SEP]
        target = [*tok.encode_digits(self.solve(digits)), EOS]
        return Problem(prompt, target)

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        draws = torch.randint(0, self.num_digits, (n, self.length), generator=generator)
        return [self.make_problem(row) for row in draws.tolist()]

    def reward(self, problem: Problem, response: list[int]) -> float:
        """Fraction of target positions matched after truncating at the first <eos>."""
        if EOS in response:
            response = response[: response.index(EOS) + 1]
        hits = sum(int(a == b) for a, b in zip(response, problem.target))
        return hits / len(problem.target)


class PromptStream:
    """Deterministic stream of prompt batches: batch i depends only on (seed, i)."""

    def __init__(self, task: DigitTask, *, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.position = 0

    def next_batch(self) -> list[Problem]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.position))
        self.position += 1
        return self.task.sample(self.batch_size, g)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("seed") != self.seed or sd.get("batch_size") != self.batch_size:
            raise ValueError(
                f"prompt stream state {sd} does not match this run (seed={self.seed}, "
                f"batch_size={self.batch_size}); resume with the config the checkpoint was made with"
            )
        self.position = int(sd["position"])


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit splitmix-style hash so that nearby (seed, position) pairs give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 29
    return x & (2**63 - 1)
