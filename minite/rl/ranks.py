"""One batch for every rank of a multi-rank run.

Every rank runs the rollout engine over the whole batch (the same prompts, the same sampling seed: under expert
parallelism the engine's forwards are collective, so all ranks step together), and the learner then splits the batch
into per-rank blocks of rows. The ranks' copies of the batch agree on CPU, but not always on a GPU: Megatron-Core's
default MoE combine adds expert outputs with bf16 atomics (`scatter_add_`), whose order varies from run to run and
rank to rank, NVFP4 turns the last-bit differences into logit differences, and a sampled token whose random draw falls
near a boundary flips. A flipped token on rank 1 would then be scored by rank 1's learner against rank 0's rollout
log-probs and mask (a 27-nat "gap" on a padding token was seen on two H200s), and each rank would compute rewards and
advantages of a different batch. So rank 0's rollouts (and recorded routes) are broadcast and every rank trains on
them; how many rows a rank's own copy had different is reported (`rollout/rows_differ`, the maximum over ranks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minite.ops import collective_device
from minite.rl.checkpoint import rank_and_world
from minite.rollout.base import RolloutResult


def rank0_rollouts(rollouts: list[RolloutResult], routes: list[torch.Tensor] | None
                   ) -> tuple[list[RolloutResult], list[torch.Tensor] | None, int | None]:
    """(rank 0's rollouts, rank 0's routes, rows whose copy differed on some rank) on every rank; a single-rank run
    gets its own back and None (nothing to compare)."""
    if rank_and_world()[1] == 1:
        return rollouts, routes, None
    box = [rollouts]
    dist.broadcast_object_list(box, src=0)
    theirs = box[0]
    if len(theirs) != len(rollouts):
        raise RuntimeError(f"rank {dist.get_rank()} generated {len(rollouts)} rollouts, rank 0 {len(theirs)}: the ranks "
                           "must run the engine over the same prompts")
    differ = sum(a.tokens != b.tokens for a, b in zip(rollouts, theirs))
    count = torch.tensor([differ], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    for r in routes or []:
        dist.broadcast(r, src=0)
    return theirs, routes, int(count.item())

