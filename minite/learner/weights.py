"""Copying named weights into a model, checked first: a learner's (name, tensor) pairs into a rollout engine, the KL
reference policy or a resumed model. Every tensor is validated (known name, not given twice, same shape, finite
floating point) and the set must be complete before anything is copied, so a rejected update leaves the old weights
untouched. The finiteness checks of all tensors are read back from the device together (one host synchronisation per
update and device).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from minite.nvfp4 import NonFiniteError
from minite.ops import first_nonfinite


class WeightUpdateError(RuntimeError):
    """A weight update was rejected; the engine's previous weights are untouched."""


class NonFiniteWeightError(WeightUpdateError, NonFiniteError):
    """A weight update was rejected because a tensor holds NaN or Inf (a learner that diverged)."""


def strip_wrapper_prefix(name: str) -> str:
    """Learner and engine may wrap the GPTModel (Float16Module, DDP): compare bare names."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def check_weights(shapes: Mapping[str, tuple], named_tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """Validate incoming (name, tensor) pairs against `shapes` (bare name -> expected shape): every name known and
    given once, the same shape, finite floating point, and the set complete. Returns bare name -> tensor (detached,
    in the order given); raises WeightUpdateError naming the offending tensor."""
    incoming: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for name, t in named_tensors:
        bare = strip_wrapper_prefix(name)
        if bare not in shapes:
            raise WeightUpdateError(f"unknown weight {name!r}: the engine has no parameter of that name")
        if bare in incoming:
            raise WeightUpdateError(f"weight {name!r} given twice")
        if tuple(t.shape) != tuple(shapes[bare]):
            raise WeightUpdateError(f"weight {name!r} has shape {tuple(t.shape)}, engine expects {tuple(shapes[bare])}")
        if not t.is_floating_point():
            raise WeightUpdateError(f"weight {name!r} is not a finite floating-point tensor")
        incoming[bare], names[bare] = t.detach(), name
    bad = first_nonfinite(incoming)
    if bad is not None:
        raise NonFiniteWeightError(f"weight {names[bad]!r} is not a finite floating-point tensor")
    missing = sorted(set(shapes) - set(incoming))
    if missing:
        raise WeightUpdateError(f"incomplete weight update: {len(missing)} parameters missing, e.g. {missing[:3]}")
    return incoming


def checked_weight_copy(params: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Validate every incoming tensor against `params` (bare name -> parameter; `check_weights`), then copy all.

    Raises WeightUpdateError, naming the offending tensor, before any copy happens.
    Returns the number of tensors copied.
    """
    incoming = check_weights({bare: tuple(p.shape) for bare, p in params.items()}, named_tensors)
    with torch.no_grad():
        for bare, t in incoming.items():
            params[bare].copy_(t)
    return len(incoming)
