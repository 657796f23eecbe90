"""Worker of test_ranks.py (two ranks): rank 1's own rollouts differ from rank 0's in one row and its recorded routes
are other values; after rank0_rollouts both ranks hold rank 0's rollouts and routes, and both report 1 row differing.
Writes rank{r}.json into the directory given."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minite.rl.ranks import rank0_rollouts
from minite.rollout.base import RolloutResult
from tests.distributed_backend import init


def main(out: Path) -> None:
    backend = init()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rollouts = [RolloutResult(i, [1, 2], [3, 4, 5], [-0.5, -0.25, -0.125], True) for i in range(4)]
    if rank == 1:  # a token flipped on rank 1 (GPU atomics, docs in minite/rl/ranks.py)
        rollouts[2] = RolloutResult(2, [1, 2], [3, 9, 0], [-0.5, -4.0, -1.0], False)
    routes = [torch.full((3, 4, 2), rank, dtype=torch.int64, device=device) for _ in range(2)]
    got, got_routes, differ = rank0_rollouts(rollouts, routes)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "backend": backend, "tokens": [r.tokens for r in got], "logprobs": [r.logprobs for r in got],
        "routes": [int(r.sum()) for r in got_routes], "same_route_objects": all(a is b for a, b in zip(got_routes, routes)),
        "differ": differ}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
