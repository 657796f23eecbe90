"""The RL loop's alignment monitor: act on each step's train/rollout log-prob gap.

The loop already computes, every step, mismatch/logp_abs_max, mismatch/logp_abs_mean and mismatch/k3_kl (the
learner's pre-update log-probs of the sampled tokens against the engine's; minite.rl.metrics) and logs them next
to reward and KL. `check_gap` compares the max with cfg.alignment's thresholds:
    warn_above  a logged warning naming the step, the gap and what to run (`minite diagnose`)
    stop_above  AlignmentError before the learner trains on the step (a run that silently went off-policy is
                worse than a stopped one)
In strict mode the expected gap is exactly 0 (docs/alignment.md), so warn_above: 0 makes any drift visible.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class AlignmentError(RuntimeError):
    """The train/rollout log-prob gap crossed alignment.stop_above."""


def check_gap(metrics: dict, alignment, step: int) -> None:
    """Warn or raise per `alignment` (an AlignmentConfig, or None for no checks) on metrics['mismatch/...']."""
    if alignment is None:
        return
    gap = float(metrics.get("mismatch/logp_abs_max", 0.0))
    mean = float(metrics.get("mismatch/logp_abs_mean", 0.0))
    hint = ("run `minite diagnose --config CONFIG --a learner --b <backend>` to locate the first divergent op"
            + ("" if alignment.strict else "; alignment.strict: true computes both sides identically"))
    if alignment.stop_above is not None and gap > alignment.stop_above:
        raise AlignmentError(f"step {step}: max |logp_learner - logp_rollout| = {gap:.3e} (mean {mean:.3e}) "
                             f"> alignment.stop_above = {alignment.stop_above:.3e}; {hint}")
    if alignment.warn_above is not None and gap > alignment.warn_above:
        log.warning("step %d: max |logp_learner - logp_rollout| = %.3e (mean %.3e) > alignment.warn_above = %.3e; %s",
                    step, gap, mean, alignment.warn_above, hint)
