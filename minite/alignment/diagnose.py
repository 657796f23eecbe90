"""`minite diagnose`: run the same token sequences through the learner and a rollout engine, op by op.

Procedure
1. Build the learner from the config and a rollout engine (embedded or sglang) holding the learner's weights.
2. The engine generates from a batch of prompts of varied lengths (random token ids, seeded), recording every op's
   input and output during its prefill and decode steps (`Capture`).
3. The learner scores the resulting sequences in one full-sequence forward, recording the same ops.
4. Compare: per-token |logp_learner - logp_engine| over every generated token, and per op the largest difference at
   positions both engines computed (position s of sequence b, for s < len_b - 1: the input tokens both engines saw).
   The first op whose outputs differ, in the learner's execution order, is the divergence; it is "local" when its
   inputs were equal (minite.alignment.compare).
The engine's positions past a sequence's end (a static batch keeps decoding until its longest sequence is done) are
masked out, and so is the learner's padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .capture import Capture, OpTrace
from .compare import compare_ops, first_divergence, logprob_gap, op_table


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
    """Ops whose rows are (position, sequence) pairs: leaf modules, and the MoE layer as a whole. Inside the MoE
    layer the experts see tokens permuted into expert order, which differs between a full forward and a decode step,
    so those rows cannot be compared one to one; the layer's output is back in token order."""
    if ".experts" in name or ".token_dispatcher" in name:
        return False
    return name.endswith(".mlp") or next(module.children(), None) is None


def run_diagnose(cfg, b: str = "embedded", params: Optional[DiagnoseParams] = None,
                 perturb: Optional[Callable[[torch.nn.Module], None]] = None) -> dict:
    """The report (see `report_json` for its keys). `perturb(engine_model)` lets a test change engine B."""
    from minite.learner.learner import Learner
    from minite.rollout import make_engine
    from minite.rollout.base import SamplingParams

    params = params or DiagnoseParams()
    cfg.rollout.backend = b
    learner = Learner(cfg)
    engine = make_engine(cfg)
    engine.update_weights(learner.named_weights())
    if perturb is not None:
        perturb(engine.model)
    prompts = random_prompts(cfg.model.vocab_size, params)
    sampling = SamplingParams(max_new_tokens=params.max_new_tokens, n=1, seed=params.seed)
    with Capture(engine.model, include=position_aligned) as cap_b:
        results = engine.generate(prompts, sampling)
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
    with Capture(learner.model, include=position_aligned) as cap_a:
        logp_a = learner.logprobs(tokens)
    valid = (torch.arange(tokens.shape[1])[:, None] < (lengths - 1)[None, :]).float()  # [s, b]
    diffs = compare_ops([_mask_rows(t, valid) for t in cap_a.ordered()],
                        [_mask_rows(t, valid) for t in cap_b.ordered()])
    op, origin = first_divergence(diffs)
    report = logprob_gap(logp_a, logp_b, mask)
    report.update(a="learner", b=b, precision=cfg.precision.mode, ops_compared=len(diffs),
                  first_divergent_op=None if op is None else op.name, origin=origin,
                  first_divergent_max_abs=None if op is None else op.max_abs, ops=op_table(diffs))
    return report


def format_report(r: dict) -> str:
    lines = [
        f"learner vs {r['b']} ({r['precision']}): {r['tokens_compared']} generated tokens compared",
        f"  |logp gap|  max {r['max_abs_logp_gap']:.3e}  mean {r['mean_abs_logp_gap']:.3e}  K3 KL {r['k3_kl']:.3e}",
        "  histogram: " + ", ".join(f"{k}: {v}" for k, v in r["histogram"].items() if v),
    ]
    if r["first_divergent_op"] is None:
        lines.append(f"  all {r['ops_compared']} captured ops agree bitwise")
    else:
        lines.append(f"  first divergent op: {r['first_divergent_op']} ({r['origin']}), "
                     f"max |diff| {r['first_divergent_max_abs']:.3e}")
        lines.append("  op                                                  out max|diff|   in max|diff|")
        for d in r["ops"][:40]:
            inp = "-" if d["input_max_abs"] is None else f"{d['input_max_abs']:.3e}"
            lines.append(f"  {d['name']:<52}{d['max_abs']:>12.3e}   {inp:>12}")
    return "\n".join(lines)
