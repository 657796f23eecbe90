"""Worker of test_decode_ranks.py (two ranks that must step together), looking for the stop token every step; each
rank runs the generate that never looks, then the one that looks, and writes rank{r}.json into the directory given:
both runs' responses and the batch size of every forward of the second. Layouts (the second argument):
  ep2  EP = 2 (the MoE layers exchange tokens every step), strict NVFP4, prompts of one length but different on each
       rank: rank 0's only response ends after three tokens; of rank 1's two, one ends early and one never.
  tp2  TP = 2 (every layer's GEMMs split over the ranks, which hold the same prompts and sample the same tokens from
       the gathered logits), default NVFP4 (strict mode needs TP = 1): of the two responses one ends early and one
       never, on both ranks alike."""
import json
import sys
from pathlib import Path

import torch.distributed as dist

from minite.config import load_config
from minite.rollout import SamplingParams
from minite.rollout.embedded import build_embedded
from tests import distributed_backend as backend

SETS = ["model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64", "model.num_experts=8",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.max_position_embeddings=64", "rl.seed=5",
        "precision.mode=nvfp4", "rollout.stop_check_every=0"]
LAYOUTS = {"ep2": ["alignment.strict=true", "parallel.ep=2"], "tp2": ["parallel.tp=2"]}


def main(out: Path, layout: str) -> None:
    backend.init()
    rank = dist.get_rank()
    engine = build_embedded(load_config(None, SETS + LAYOUTS[layout]))
    if layout == "tp2":  # one batch over the TP group
        prompts, params = [[4, 5, 6], [9, 10, 11]], dict(max_new_tokens=12, seed=4)
    else:
        prompts = [[1, 2, 3]] if rank == 0 else [[4, 5, 6], [9, 10, 11]]
        params = dict(max_new_tokens=12, seed=3 + rank)
    free = [(r.tokens, r.logprobs) for r in engine.generate(prompts, SamplingParams(**params))]
    if rank == 0 and layout == "ep2":
        stop = free[0][0][2]
    else:  # a token of the first response that the second never samples: the batch halves, then runs on
        stop = next(t for t in free[0][0][:8] if t not in free[1][0])
    engine.decoder.stop_check_every = 1
    rows = []
    engine.model.register_forward_pre_hook(lambda mod, args, kwargs: rows.append(int(args[0].shape[0])),
                                           with_kwargs=True)
    cut = [(r.tokens, r.logprobs, r.finished) for r in
           engine.generate(prompts, SamplingParams(**params, stop_token_id=stop))]
    (out / f"rank{rank}.json").write_text(json.dumps({"free": free, "cut": cut, "stop": stop, "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ep2")
