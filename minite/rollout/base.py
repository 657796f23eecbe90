"""The rollout engine interface: sample responses with log-probs; take new weights from the learner.

Every backend (embedded Megatron-Core, SGLang) implements two calls:

    generate(prompts, SamplingParams) -> list[RolloutResult]
        len(prompts) * n results, grouped: results[i * n + j] is sample j of prompt i (GRPO groups).
        Each result carries the response token ids and, per token, the log-prob of the sampled token
        under the policy at temperature 1 and without top-p truncation: log softmax(logits)[token].
        That is the number the learner computes, so the two can be compared token by token
        (the mismatch metrics). With temperature != 1 or top_p < 1 the tokens are drawn from the
        tempered/truncated distribution while the log-probs stay those of the untempered policy.
        A response ends at the first stop token (included, with its log-prob) or at
        max_new_tokens (finished=False).

    update_weights(named_tensors)
        Replace the policy weights with the learner's (names as the learner's model names them;
        a leading "module." wrapper prefix is ignored). All-or-nothing: every tensor is validated
        (known name, complete set, same shape, finite values) before any is copied, so a failed
        update raises WeightUpdateError and the engine keeps serving the old weights.

Sampling is reproducible: the same weights, prompts and SamplingParams.seed give the same tokens,
and an engine never touches the global torch RNG (the RL loop's checkpoints rely on that).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

import torch

from minite.learner.weights import (WeightUpdateError, check_weights, checked_weight_copy,  # noqa: F401
                                   strip_wrapper_prefix)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature for sampling (> 0). Reported log-probs are at temperature 1 regardless."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    max_new_tokens: int = 16
    """Most response tokens per sample, stop token included."""
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    seed: int = 0
    """Seed of the sampling generator for this call."""
    stop_token_id: int | None = None
    """Token that ends a response (kept in the response), or None to always run max_new_tokens."""

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {self.max_new_tokens}, {self.n}")


@dataclass
class RolloutResult:
    prompt_index: int
    """Index into the prompts passed to generate."""
    prompt: list[int]
    tokens: list[int]
    """Response token ids (stop token included when finished)."""
    logprobs: list[float] = field(default_factory=list)
    """log p(tokens[k] | prompt, tokens[:k]) at temperature 1, one per token."""
    finished: bool = False
    """True when the response ended with the stop token."""


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutResult]: ...

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def truncate_at_stop(tokens: list[int], logprobs: list[float], stop: int | None) -> tuple[list[int], list[float], bool]:
    """Cut a response after its first stop token (kept). Returns (tokens, logprobs, finished)."""
    if stop is not None and stop in tokens:
        k = tokens.index(stop) + 1
        return tokens[:k], logprobs[:k], True
    return tokens, logprobs, False
