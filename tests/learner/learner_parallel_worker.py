"""torchrun worker: TP=2 and EP=2 learners against the unsharded learner on the same inputs (several configs per launch).

For each (precision, layout) the worker builds the unsharded learner (tp=ep=1, i.e. two data-parallel replicas that
split the batch's rows, which equals one process: test_data_parallel.py), records its weights, log-probs, one train
step's grad norm and the log-probs after that step, then rebuilds the Megatron parallel state with the sharded
layout and checks:
  1. initial weights: the shards gathered over TP/EP equal the unsharded weights exactly (layout-invariant init);
  2. log-probs before training: equal up to the cross-rank summation order (tolerances.py);
  3. grad norm and log-probs after one Adam step: close (tolerances.py says why they are looser);
  4. log-probs with every router replaying fixed routes (routing replay): as close as 2.
Then, for TP=2 alone: every rank's grad norm and the TP ranks' whole copies of parameters after clipped steps.
Rank 0 writes a JSON report to argv[1]; the pytest wrapper (test_learner_parallel.py) asserts on it.
"""
import json
import sys
import traceback

import torch
import torch.distributed as dist

from minite.config import load_config
from minite.learner.learner import Learner
from tests import distributed_backend as backend

CONFIGS = [  # (precision, tp, ep)
    ("bf16", 2, 1),
    ("nvfp4", 2, 1),
    ("bf16", 1, 2),
    ("nvfp4", 1, 2),
]


def make_cfg(precision, tp, ep, *extra):
    return load_config(None, list(extra) + [
        f"precision.mode={precision}", "precision.compute_dtype=float32", f"parallel.tp={tp}", f"parallel.ep={ep}",
        "optim.lr=1e-3", "rl.seed=7", "model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64",
        "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
    ])


def loss_fn(logp):
    loss = -logp.mean()
    return loss, {}


def grads(learner, tokens):
    """main_grad of every parameter after one backward of loss_fn and Megatron's grad finalisation (no step)."""
    from megatron.core.distributed import finalize_model_grads
    from minite.learner.learner import token_logprobs
    from minite.megatron_patches.cpu import cuda_as_cpu
    learner.ddp.zero_grad_buffer()
    loss_fn(token_logprobs(learner._logits(tokens), tokens))[0].backward()
    with cuda_as_cpu():
        finalize_model_grads([learner.ddp])
    out = {name: p.main_grad.detach().clone() for name, p in learner.model.named_parameters()}
    learner.ddp.zero_grad_buffer()
    return out


def full(learner, tp, ep, tensors=None):
    """Gathered unsharded tensors: the weights (Learner.full_weights) or per-parameter grads (same layout rules)."""
    if tensors is None:
        return dict(learner.full_weights())
    saved = {n: p.data for n, p in learner.model.named_parameters()}
    try:  # reuse full_weights' gather/reorder rules on the gradient tensors
        for n, p in learner.model.named_parameters():
            p.data = tensors[n].to(p.dtype)
        return dict(learner.full_weights())
    finally:
        for n, p in learner.model.named_parameters():
            p.data = saved[n]


def replayed_logprobs(learner, tokens):
    """Log-probs with every router replaying fixed routes (minite.alignment.routing_replay, as the RL loop replays
    the engine's): each layer's position p of row b goes to experts (p + b + layer) % E and (p + 2b + layer + 1) % E.
    T = 31: under sequence parallelism the learner pads to 32 and each TP rank replays its slice."""
    from minite.alignment.routing_replay import learner_replay
    toks = tokens[:, :31]
    t, b, e = toks.shape[1], toks.shape[0], learner.cfg.model.num_experts
    pos, row = torch.arange(t)[:, None], torch.arange(b)[None, :]
    routes = [torch.stack([(pos + row + i) % e, (pos + 2 * row + i + 1) % e], dim=-1) for i in range(2)]
    with learner_replay(learner, routes, t, list(learner.local_rows(b))):  # its data-parallel rows, as the loop does
        return learner.logprobs(toks)


def run(precision, tp, ep, tokens):
    from megatron.core import parallel_state as ps
    results = {}
    ps.destroy_model_parallel()
    ref = Learner(make_cfg(precision, 1, 1))
    ref_w = {k: v.detach().clone() for k, v in ref.model.named_parameters()}
    ref_lp0 = ref.logprobs(tokens)
    ref_lp_replay = replayed_logprobs(ref, tokens)
    ref_g = grads(ref, tokens)
    if ref.nvfp4 is not None:  # the same run with other stochastic-rounding draws: the noise floor of NVFP4 grads
        ref.nvfp4.seed += 1
        ref_g2 = grads(ref, tokens)
        ref.nvfp4.seed -= 1
        results["grad_rel_max_seed_to_seed"] = max(float((ref_g2[k] - ref_g[k]).norm()
                                                         / ref_g[k].norm().clamp_min(1e-30)) for k in ref_g)
    ref_m = ref.train_step(tokens, loss_fn)
    ref_lp1 = ref.logprobs(tokens)
    ps.destroy_model_parallel()
    sh = Learner(make_cfg(precision, tp, ep))
    sh_w = full(sh, tp, ep)
    results["weights_equal"] = set(sh_w) == set(ref_w) and all(torch.equal(sh_w[k], ref_w[k]) for k in ref_w)
    lp0 = sh.logprobs(tokens)
    results["logp_replay_max_abs"] = float((replayed_logprobs(sh, tokens) - ref_lp_replay).abs().max())
    results["replay_moves_logp"] = float((ref_lp_replay - ref_lp0[:, :30]).abs().max())
    sh_g = full(sh, tp, ep, grads(sh, tokens))
    # per parameter: |g - g_ref| / |g_ref| (Frobenius), the worst over parameters
    results["grad_rel_max"] = max(float((sh_g[k] - ref_g[k]).norm() / ref_g[k].norm().clamp_min(1e-30))
                                  for k in ref_g)
    results["grad_rel_worst_param"] = max(ref_g, key=lambda k: float((sh_g[k] - ref_g[k]).norm()
                                                                     / ref_g[k].norm().clamp_min(1e-30)))
    m = sh.train_step(tokens, loss_fn)
    lp1 = sh.logprobs(tokens)
    results["logp0_max_abs"] = float((lp0 - ref_lp0).abs().max())
    results["grad_norm_rel"] = abs(m["grad_norm"] - ref_m["grad_norm"]) / ref_m["grad_norm"]
    results["logp1_max_abs"] = float((lp1 - ref_lp1).abs().max())
    results["loss_ref"], results["loss"] = ref_m["loss"], m["loss"]
    return results


def shared_expert_tp(tokens):
    """TP=2 with a shared expert (SwiGLU, column/row-parallel): Megatron's CPU init splits the [gate; up] master
    by rows, so the TP=2 model is not the TP=1 one; instead its full_weights() loaded into the unsharded model must
    reproduce its log-probs."""
    from megatron.core import parallel_state as ps
    extra = ["model.shared_expert_intermediate_size=32"]
    ps.destroy_model_parallel()
    sh = Learner(make_cfg("bf16", 2, 1, *extra))
    lp_sh = sh.logprobs(tokens)
    weights = dict(sh.full_weights())
    ps.destroy_model_parallel()
    ref = Learner(make_cfg("bf16", 1, 1, *extra))
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            p.copy_(weights[name])
    return {"logp_max_abs": float((ref.logprobs(tokens) - lp_sh).abs().max())}


def tp_replicas_after_clipped_steps(precision, tokens):
    """TP=2 with every step clipped (optim.clip_grad far below the gradient norm): every rank's grad norm, and the
    parameters the TP ranks hold whole (norms, routers, the experts: EP = 1, expert TP 1) that differ between them
    after three steps. Megatron-Core 0.16.1's expert optimizer counted the experts in the norm on TP rank 0 only
    (megatron_patches/grad_stats.py), so the ranks clipped by different factors and their replicas drifted apart."""
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    sh = Learner(make_cfg(precision, 2, 1, "optim.clip_grad=1e-3"))
    norms = []
    for _ in range(3):
        norms.append(sh.train_step(tokens, loss_fn)["grad_norm"])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, norms)
    differ = []
    for name, p in sh.model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        both = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(both, p.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        if not torch.equal(both[0], both[1]):
            differ.append(name)
    return {"grad_norms_by_rank": gathered, "replicas_differ": differ}


def main():
    backend.init()
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 32))
    report = {}
    for precision, tp, ep in CONFIGS:
        key = f"{precision}_tp{tp}_ep{ep}"
        try:
            report[key] = run(precision, tp, ep, tokens)
        except Exception:  # report, do not hang the other rank's collectives forever
            report[key] = {"error": traceback.format_exc()}
            break
    if "error" not in str(report):
        try:
            report["bf16_tp2_shared_expert_full_weights"] = shared_expert_tp(tokens)
        except Exception:
            report["bf16_tp2_shared_expert_full_weights"] = {"error": traceback.format_exc()}
    for precision in ("bf16", "nvfp4"):
        if "error" in str(report):
            break
        try:
            report[f"{precision}_tp2_clipped_replicas"] = tp_replicas_after_clipped_steps(precision, tokens)
        except Exception:
            report[f"{precision}_tp2_clipped_replicas"] = {"error": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
