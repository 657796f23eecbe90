"""`minite diagnose`: run the same token sequences through the learner and a rollout engine, op by op.

Procedure
1. Build the learner from the config and a rollout engine (embedded or sglang) holding the learner's weights.
2. The engine generates from a batch of prompts of varied lengths (random token ids, seeded), recording every op's
   input and output during its prefill and decode steps (`Capture`).
3. The learner scores the resulting sequences in one full-sequence forward, recording the same ops (under TP
   without sequence parallelism, so that every rank's ops see whole sequences as the engine's do).
4. Compare: per-token |logp_learner - logp_engine| over every generated token, and per op the largest difference at
   positions both engines computed (position s of sequence b, for s < len_b - 1: the input tokens both engines saw).
   The first op whose outputs differ, in the learner's execution order, is the divergence; it is "local" when its
   inputs were equal (minite.alignment.compare).
The engine's positions past a sequence's end (a static batch keeps decoding until its longest sequence is done) are
masked out, and so is the learner's padding.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from minite.learner.learner import Learner
from minite.megatron_patches.qwen3_moe import sequence_parallel_off
from minite.rollout import make_engine
from minite.rollout.base import SamplingParams

from .capture import Capture, OpTrace
from .compare import compare_ops, first_divergence, logprob_gap, op_table
from .routing_replay import has_routers, record_routes, replay_routes, replay_targets, route_flips


@dataclass(kw_only=True)
class DiagnoseParams:
    num_prompts: int = 8
    min_prompt_len: int = 2
    max_prompt_len: int = 9
    max_new_tokens: int = 6
    seed: int = 0


def random_prompts(vocab: int, p: DiagnoseParams) -> list[list[int]]:
    """Prompts of varied lengths with ids in [1, vocab) (0 is padding), from a seeded generator."""
    g = torch.Generator().manual_seed(p.seed)
    lengths = torch.randint(p.min_prompt_len, p.max_prompt_len + 1, (p.num_prompts,), generator=g)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _mask_rows(trace: OpTrace, valid: torch.Tensor) -> OpTrace:
    """Zero out rows at invalid (position, sequence) pairs, so both engines' don't-care rows compare equal."""
    out = OpTrace(trace.name, trace.order)
    for which in ("inputs", "outputs"):
        t = trace.stacked(which)
        if t is not None:
            t = _apply_valid(t, valid)
        getattr(out, which).append(t)
    return out


def _apply_valid(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    s_max, b = valid.shape
    if t.dim() >= 2 and t.shape[1] == b and t.shape[0] <= s_max:  # [s, b, ...]
        m = valid[:t.shape[0]].reshape(t.shape[0], b, *([1] * (t.dim() - 2)))
        return t * m
    if t.shape[0] % b == 0 and t.shape[0] // b <= s_max:  # [s * b, ...], s-major
        m = valid[:t.shape[0] // b].reshape(-1, *([1] * (t.dim() - 1)))
        return t * m
    return t


def position_aligned(name: str, module: torch.nn.Module) -> bool:
    """Ops whose rows are (position, sequence) pairs: leaf modules, core attention and the MoE layer as a whole.
    Inside the MoE layer the experts see tokens permuted into expert order, which differs between a full forward
    and a decode step, so those rows cannot be compared one to one (the layer's output is back in token order);
    inside core attention the score matrices are [b, heads, sq, sk] (the context output is per position).
    The RoPE table (rotary_pos_emb) is left out: its rows are positions of a table whose length is the engine's
    maximum sequence length, not (position, sequence) pairs; RoPE's effect is compared at core attention's input
    (the rotated query)."""
    if ".experts" in name or ".token_dispatcher" in name or ".core_attention." in name:
        return False
    if name == "rotary_pos_emb":
        return False
    if name.endswith(".mlp") or name.endswith(".core_attention"):
        return True
    return next(module.children(), None) is None


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def build_pair(cfg, b: str = "embedded"):
    """(learner, engine B holding the learner's weights) for `cfg`."""
    cfg.rollout.backend = b
    learner = Learner(cfg)
    engine = make_engine(cfg)
    engine.update_weights(learner.named_weights())
    return learner, engine


def _score_layout(results) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], lengths [B], response mask [B, T-1], engine log-probs [B, T-1]) from rollout results."""
    seqs = [r.prompt + r.tokens for r in results]
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    mask = torch.zeros(len(seqs), tokens.shape[1] - 1)
    logp_b = torch.zeros_like(mask, dtype=torch.float64)
    for i, (r, s) in enumerate(zip(results, seqs)):
        tokens[i, :len(s)] = torch.tensor(s)
        start = len(r.prompt) - 1
        mask[i, start:start + len(r.tokens)] = 1
        logp_b[i, start:start + len(r.tokens)] = torch.tensor(r.logprobs, dtype=torch.float64)
    return tokens, lengths, mask, logp_b


def diagnose_pair(learner, engine, cfg, params: Optional[DiagnoseParams] = None, b: str = "embedded") -> dict:
    """Generate with `engine` and score with `learner`, capturing ops on both; the report (see the module
    docstring). With cfg.alignment.routing_replay the learner replays the engine's expert routes."""
    params = params or DiagnoseParams()
    replay = bool(getattr(getattr(cfg, "alignment", None), "routing_replay", False))
    prompts = random_prompts(cfg.model.vocab_size, params)
    sampling = SamplingParams(max_new_tokens=params.max_new_tokens, n=1, seed=params.seed)
    model_b = getattr(engine, "model", None)  # SGLang runs its model in a scheduler process: no module tree here
    routed = model_b is not None and has_routers(model_b)
    if replay and not routed:
        raise ValueError(f"routing replay: engine {b!r} does not expose Megatron routers to record")
    with contextlib.ExitStack() as stack:
        cap_b = stack.enter_context(Capture(model_b if model_b is not None else torch.nn.Module(),
                                            include=position_aligned))
        rec_b = stack.enter_context(record_routes(engine.model)) if routed else None
        if hasattr(engine, "observed"):  # hooks see every step (no graph replays) and every prefill position
            stack.enter_context(engine.observed())
        results = engine.generate(prompts, sampling)
    tokens, lengths, mask, logp_b = _score_layout(results)
    routes_b = rec_b.routes(len(results)) if routed else None
    valid = (torch.arange(tokens.shape[1])[:, None] < (lengths - 1)[None, :]).float()  # [s, b]
    with contextlib.ExitStack() as stack:
        cap_a = stack.enter_context(Capture(learner.model, include=position_aligned))
        if replay:
            stack.enter_context(replay_routes(learner.model, replay_targets(routes_b, tokens.shape[1])))
        elif routed:
            rec_a = stack.enter_context(record_routes(learner.model))
        # under TP the learner's ops run on whole sequences, as the engine's do (its training keeps them split)
        stack.enter_context(sequence_parallel_off(learner.model))
        logp_a = learner.logprobs(tokens.to(_device(learner.model))).cpu()
    flips = None if replay or not routed else route_flips(rec_a.routes(len(results)), routes_b, valid)
    diffs = compare_ops([_mask_rows(t, valid) for t in cap_a.ordered()],
                        [_mask_rows(t, valid) for t in cap_b.ordered()])
    op, origin = first_divergence(diffs)
    report = logprob_gap(logp_a, logp_b, mask)
    report.update(a="learner", b=b, precision=cfg.precision.mode, ops_compared=len(diffs),
                  strict=bool(getattr(getattr(cfg, "alignment", None), "strict", False)), routing_replay=replay,
                  route_flips=flips, batch=len(results), prompt_lengths=[len(p) for p in prompts],
                  ops_captured=model_b is not None,
                  first_divergent_op=None if op is None else op.name, origin=origin,
                  first_divergent_max_abs=None if op is None else op.max_abs, ops=op_table(diffs))
    return report


def run_diagnose(cfg, b: str = "embedded", params: Optional[DiagnoseParams] = None,
                 perturb: Optional[Callable[[torch.nn.Module], None]] = None) -> dict:
    """The report (see `diagnose_pair`). `perturb(engine_model)` lets a test change engine B."""
    learner, engine = build_pair(cfg, b)
    try:
        if perturb is not None:
            perturb(engine.model)
        return diagnose_pair(learner, engine, cfg, params, b)
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def format_report(r: dict) -> str:
    lines = [
        f"learner vs {r['b']} ({r['precision']}): {r['tokens_compared']} generated tokens compared",
        f"  |logp gap|  max {r['max_abs_logp_gap']:.3e}  mean {r['mean_abs_logp_gap']:.3e}  K3 KL {r['k3_kl']:.3e}",
        f"  strict={r.get('strict')} routing_replay={r.get('routing_replay')} "
        f"expert-route flips (learner vs engine, own routing): {r.get('route_flips')}",
        "  histogram: " + ", ".join(f"{k}: {v}" for k, v in r["histogram"].items() if v),
    ]
    if not r.get("ops_captured", True):
        lines.append(f"  engine {r['b']} exposes no module tree in this process: ops not compared")
    elif r["first_divergent_op"] is None:
        lines.append(f"  all {r['ops_compared']} captured ops agree bitwise")
    else:
        lines.append(f"  first divergent op: {r['first_divergent_op']} ({r['origin']}), "
                     f"max |diff| {r['first_divergent_max_abs']:.3e}")
        lines.append("  op                                                  out max|diff|   in max|diff|")
        for d in r["ops"][:40]:
            inp = "-" if d["input_max_abs"] is None else f"{d['input_max_abs']:.3e}"
            lines.append(f"  {d['name']:<52}{d['max_abs']:>12.3e}   {inp:>12}")
    return "\n".join(lines)
