"""Worker for test_data_parallel.py: GRPO train steps on one fixed batch, unsharded or with the rows split over DP.

    python data_parallel_worker.py OUT_DIR            the single-process reference (world size 1, TP = EP = DP = 1)
    torchrun --nproc_per_node 2 data_parallel_worker.py OUT_DIR
                                                       every layout in CONFIGS on 2 ranks (one launch)

Each run builds the learner from the same config (the initial model is layout-invariant), scores the batch
(`logprobs`, the old policy), then runs STEPS GRPO steps (token-mean over the response tokens of the whole batch,
TIS correction, K3 KL) with the old log-probs held fixed, so later steps clip. The batch's rows have unequal
response lengths and rank 0's rows hold fewer tokens than rank 1's, so a per-rank token mean averaged over ranks
would differ from the global token mean (the reference reports both). Sharded runs also record which rows each
rank's model forward received. Rank 0 writes OUT_DIR/<name>.json (metrics, log-probs, rows seen) and
OUT_DIR/<name>.pt (the updated weights gathered to TP = EP = 1); exceptions go into the JSON.
"""
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from minite.config import load_config
from minite.learner.learner import Learner
from minite.rl.grpo import GRPOParams, grpo_loss
from tests import distributed_backend as backend

CONFIGS = {"bf16_dp2": (1, 1), "bf16_ep2_dp2": (1, 2)}  # name: (tp, ep); world size 2, so DP = 2 for dense params
STEPS = 3
PROMPT_LEN, RESPONSE_LENS, WIDTH = 4, (2, 9, 5, 11), 16  # rank 0 holds 11 response tokens, rank 1 holds 16
ADVANTAGES = (1.0, -0.5, 0.8, -1.3)
PARAMS = GRPOParams(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05, is_correction="tis", is_cap=2.0)


def make_cfg(tp, ep):
    return load_config(None, [
        "precision.mode=bf16", "precision.compute_dtype=float32", f"parallel.tp={tp}", f"parallel.ep={ep}",
        "optim.lr=1e-3", "rl.seed=7", "model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64",
        "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
    ])


def make_batch():
    """Right-padded rows prompt + response (+ 0s), the response-column mask and per-row advantages."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.zeros(len(RESPONSE_LENS), WIDTH, dtype=torch.long)
    mask = torch.zeros(len(RESPONSE_LENS), WIDTH - 1)
    for i, n in enumerate(RESPONSE_LENS):
        tokens[i, : PROMPT_LEN + n] = torch.randint(1, 64, (PROMPT_LEN + n,), generator=gen)
        mask[i, PROMPT_LEN - 1 : PROMPT_LEN - 1 + n] = 1
    return tokens, mask, torch.tensor(ADVANTAGES)


def record_rows(learner):
    """A forward pre-hook on the GPTModel: the token rows of every forward this rank runs."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((args[0] if args else kwargs["input_ids"]).detach().clone())

    return seen, learner.model.register_forward_pre_hook(hook, with_kwargs=True)


def replay_check(learner, tokens):
    """Routing replay (the loop's path) with the rows split over DP: record the routes of the whole batch on this
    rank (TP = EP = 1: the forward has no collectives), replay them through loop._replay for the whole batch and
    for a minibatch of rows 2-3; replaying the routes the router picks anyway must leave the log-probs unchanged,
    while replaying another row's routes (rows 3, 2) must not."""
    from minite.alignment.routing_replay import record_routes
    from minite.rl.loop import _replay
    t = tokens.shape[1]
    with torch.no_grad(), record_routes(learner.model) as rec:
        learner._logits(tokens)
    routes, gaps = rec.routes(tokens.shape[0]), {}
    for name, rows in (("full", [0, 1, 2, 3]), ("minibatch", [2, 3]), ("wrong_rows", [3, 2])):
        free = learner.logprobs(tokens[sorted(rows)])
        with _replay(learner, routes, t, rows):
            got = learner.logprobs(tokens[sorted(rows)])
        gaps[name] = float((got - free).abs().max())
    return gaps


def run(tp, ep):
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    learner = Learner(make_cfg(tp, ep))
    tokens, mask, adv = make_batch()
    seen, handle = record_rows(learner)
    old = learner.logprobs(tokens)
    mask, adv = mask.to(old.device), adv.to(old.device)  # the batch is made on the host, log-probs on the learner's
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(old.shape, generator=gen).to(old.device)
    rollout = old + 0.3 * noise * mask  # engine-vs-learner mismatch for TIS
    ref = old - 0.1 * mask

    def loss_fn(logp):
        return grpo_loss(logp, old, adv, mask, PARAMS, rollout_logp=rollout, ref_logp=ref)

    steps = [learner.train_step(tokens, loss_fn) for _ in range(STEPS)]
    handle.remove()
    odd_rows_error = None
    if ps.get_data_parallel_world_size() > 1:
        try:  # 3 rows over 2 DP ranks: raised before any collective, on every rank alike
            learner.train_step(tokens[:3], loss_fn)
        except ValueError as e:
            odd_rows_error = str(e)
    rows = learner.local_rows(tokens.shape[0])
    replay_gaps = replay_check(learner, tokens) if tp == ep == 1 and ps.get_data_parallel_world_size() > 1 else None
    out = {"steps": steps, "logp0": old.cpu().tolist(), "rows": [rows.start, rows.stop], "forwards": len(seen),
           "saw_only_its_rows": all(torch.equal(t.cpu(), tokens[rows.start:rows.stop]) for t in seen),
           "odd_rows_error": odd_rows_error, "replay_gaps": replay_gaps, "dp": ps.get_data_parallel_world_size(),
           "local_experts": learner.model.decoder.layers[0].mlp.experts.num_local_experts}
    if dist.get_world_size() == 1:  # what a per-rank token mean averaged over 2 ranks would have given at step 0
        halves = [grpo_loss(old[s], old[s], adv[s], mask[s], PARAMS, rollout_logp=rollout[s], ref_logp=ref[s])[0]
                  for s in (slice(0, 2), slice(2, 4))]
        out["loss0_mean_of_rank_means"] = float(sum(halves) / 2)
    return out, dict(learner.full_weights())


def main():
    out_dir = Path(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend.init()
    configs = CONFIGS if world > 1 else {"single": (1, 1)}
    failed = False
    for name, (tp, ep) in configs.items():
        try:
            report, weights = run(tp, ep) if not failed else ({"error": "skipped after an earlier error"}, None)
            reports = [None] * dist.get_world_size()
            mine = ("rows", "forwards", "saw_only_its_rows", "replay_gaps")
            dist.all_gather_object(reports, {k: report[k] for k in mine} if "error" not in report else {})
            report["per_rank"] = reports
        except Exception:  # report, do not hang the other rank's collectives forever
            report, weights, failed = {"error": traceback.format_exc()}, None, True
        if not dist.is_initialized() or dist.get_rank() == 0:
            (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
            if weights is not None:
                torch.save(weights, out_dir / f"{name}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
