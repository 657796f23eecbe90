"""Compare two engines: per-token log-prob gaps, and the first op whose outputs differ and where that comes from.

Origin of a divergence. Ops are walked in the reference engine's execution order. The first op whose outputs differ
is "local" when its inputs were identical in both engines (the op itself computes differently: a kernel, an epsilon,
a reduction order) and "propagated" when its inputs already differed (something upstream that was not captured
as an op, such as an in-place update, a functional call or a cache, changed them first).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .capture import OpTrace


@dataclass
class OpDiff:
    name: str
    rows: int
    max_abs: float
    mean_abs: float
    input_max_abs: Optional[float]

    @property
    def differs(self) -> bool:
        return self.max_abs > 0 or math.isnan(self.max_abs)


def _common_rows(a: torch.Tensor, b: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if a.shape[1:] != b.shape[1:]:
        return None
    n = min(a.shape[0], b.shape[0])
    return a[:n], b[:n]


def _diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[tuple[int, float, float]]:
    if a is None or b is None:
        return None
    pair = _common_rows(a, b)
    if pair is None or pair[0].numel() == 0:
        return None
    d = (pair[0].double() - pair[1].double()).abs()
    d = torch.where(torch.isnan(pair[0]) & torch.isnan(pair[1]), torch.zeros_like(d), d)
    return pair[0].shape[0], float(d.max()), float(d.mean())


def compare_ops(a: list[OpTrace], b: list[OpTrace]) -> list[OpDiff]:
    """One OpDiff per op present in both captures, in a's execution order."""
    by_name = {t.name: t for t in b}
    out = []
    for ta in a:
        tb = by_name.get(ta.name)
        if tb is None:
            continue
        od = _diff(ta.stacked("outputs"), tb.stacked("outputs"))
        if od is None:
            continue
        idiff = _diff(ta.stacked("inputs"), tb.stacked("inputs"))
        out.append(OpDiff(ta.name, od[0], od[1], od[2], None if idiff is None else idiff[1]))
    return out


def first_divergence(diffs: list[OpDiff]) -> tuple[Optional[OpDiff], Optional[str]]:
    """(first op whose outputs differ, "local" | "propagated"), or (None, None) when every op agrees."""
    for d in diffs:
        if d.differs:
            local = d.input_max_abs is not None and d.input_max_abs == 0
            return d, "local" if local else "propagated"
    return None, None


def logprob_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    """Statistics of |a - b| over masked tokens, with a histogram in decades (exact zeros counted apart)."""
    gap = (a.double() - b.double()).abs()[mask.bool()]
    n = int(gap.numel())
    hist = {"0": int((gap == 0).sum())}
    edges = [0.0] + [10.0 ** e for e in range(-12, 1)] + [math.inf]
    for lo, hi in zip(edges[:-1], edges[1:]):
        label = f"({lo:.0e}, {hi:.0e}]" if lo > 0 else f"(0, {hi:.0e}]"
        hist[label] = int(((gap > lo) & (gap <= hi)).sum())
    k3 = (torch.exp(b.double() - a.double()) - (b.double() - a.double()) - 1)[mask.bool()]
    return {
        "tokens_compared": n,
        "max_abs_logp_gap": float(gap.max()) if n else 0.0,
        "mean_abs_logp_gap": float(gap.mean()) if n else 0.0,
        "k3_kl": float(k3.mean()) if n else 0.0,
        "histogram": hist,
    }


def op_table(diffs: list[OpDiff]) -> list[dict]:
    return [asdict(d) for d in diffs]
