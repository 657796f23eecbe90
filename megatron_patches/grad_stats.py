"""The expert optimizer's gradient statistics counted by expert tensor-parallel ownership (Megatron-Core 0.16.1).

`get_megatron_optimizer` builds one child optimizer for the dense parameters and one for the experts (a
ChainedOptimizer), and gives both the dense tensor-parallel group as `tp_group`. Their gradient-norm filter
(`param_is_not_tensor_parallel_duplicate`) keeps a parameter that is not TP-partitioned only on TP rank 0 of that
group. The experts are not split by the dense TP group but by the expert TP group (here always of size 1), and the
expert child reduces its norm over the expert tensor/model/pipeline group, which holds no other dense TP rank. So
with TP > 1 every dense TP rank but the first drops the experts from the norm: the ranks of one TP group clip with
different coefficients and their replicas of the experts and routers drift apart from the first clipped step
(measured on the CPU with gloo, TP = 2: grad norm 2.5707 on rank 0, 2.5632 on rank 1; docs/upstream.md). Upstream
fixed it after 0.16.1 (Megatron-LM pull request 5916: each child deduplicates with its own TP group).
`count_experts_by_expert_tp(optimizer)` does that here: the expert child's `tp_group` becomes the expert TP group.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _is_expert_child(child) -> bool:
    return any(group.get("is_expert_parallel", False) for group in child.optimizer.param_groups)


def count_experts_by_expert_tp(optimizer) -> bool:
    """Give the expert child of a Megatron (chained) optimizer the expert TP group for its duplicate filter. Idempotent;
    returns whether a child was changed (False with no expert child, or when the groups are already the same)."""
    from megatron.core import parallel_state as ps

    expert_tp = ps.get_expert_tensor_parallel_group()
    changed = False
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        if _is_expert_child(child) and getattr(child, "tp_group", None) is not expert_tp:
            child.tp_group = expert_tp
            changed = True
    if changed:
        logger.info("expert optimizer: gradient norm counts experts by expert tensor-parallel rank (Megatron-LM #5916)")
    return changed
