"""Capture each op's input and output during a forward, under canonical names, for engine-vs-engine comparison.

Two engines run the same token sequences differently: the learner in one full-sequence forward, a rollout engine in a
prefill then one decode step per token. Forward hooks on named submodules record, per call, the first tensor the
module received and the first tensor it returned. Calls of one module are concatenated along the sequence dim, so a
prefill of P positions followed by single-position decode steps lines up row for row with the full-sequence forward
(Megatron's activations are [s, b, h] and flattened token rows are s-major, so dim 0 is position-major either way).

Names are canonical: wrapper prefixes (Float16Module's and DDP's `module.`) are stripped, and an engine whose module
tree uses other names (SGLang) passes a `canonical` function that maps its names onto the learner's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


def first_tensor(obj) -> Optional[torch.Tensor]:
    if torch.is_tensor(obj):
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            t = first_tensor(item)
            if t is not None:
                return t
    if isinstance(obj, dict):
        for item in obj.values():
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


@dataclass
class OpTrace:
    """Every call of one op: inputs and outputs in call order, and the op's place in execution order."""

    name: str
    order: int
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def stacked(self, which: str) -> Optional[torch.Tensor]:
        parts = [t for t in getattr(self, which) if t is not None]
        if not parts:
            return None
        try:
            return torch.cat(parts, dim=0)
        except RuntimeError:  # shapes that don't line up along dim 0 (not comparable row by row)
            return None


class Capture:
    """Context manager: hook every submodule accepted by `include` and record its calls.

    include(name, module) -> bool picks the ops (default: every module that has no children, plus any module
    whose canonical name is listed in `extra`). canonical(name) -> str | None renames (None drops the op).
    """

    def __init__(self, model: torch.nn.Module, *, include: Callable[[str, torch.nn.Module], bool] | None = None,
                 canonical: Callable[[str], Optional[str]] | None = None):
        self.model = model
        self.include = include or (lambda name, module: next(module.children(), None) is None)
        self.canonical = canonical or strip_wrappers
        self.traces: dict[str, OpTrace] = {}
        self._handles = []

    def _hook(self, name: str):
        def hook(module, args, output):
            trace = self.traces.get(name)
            if trace is None:
                trace = self.traces[name] = OpTrace(name, len(self.traces))
            x, y = first_tensor(args), first_tensor(output)
            # on the CPU: comparisons mix both engines' captures with CPU masks, and GPU memory stays free
            trace.inputs.append(None if x is None else x.detach().float().cpu().clone())
            trace.outputs.append(None if y is None else y.detach().float().cpu().clone())
        return hook

    def __enter__(self) -> "Capture":
        for raw, module in self.model.named_modules():
            if not raw:
                continue
            name = self.canonical(raw)
            if name is not None and self.include(name, module):
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def ordered(self) -> list[OpTrace]:
        return sorted(self.traces.values(), key=lambda t: t.order)
