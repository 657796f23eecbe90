"""The rollout's token sampler alone: Megatron's ops against the Gumbel kernels, and the log-softmaxes that follow it.

    python tools/bench/bench_sampler.py --out /tmp/sampler.json [--batches 1,8,64,256] [--vocab 151936]
        [--rounds 2] [--layouts QUARTER:WARPS,...]

For fp32 logits [batch, vocab] (randn * 3; the rollout slice's vocabulary by default), triton.testing.do_bench's
median of: `minite.rollout.decode.sample` with sampler "megatron" and "gumbel" at temperature 1 and 0.7; the
default mode's log-probs (torch's whole log-softmax, then the gather) and strict mode's (`minite.strict.ops.
token_log_softmax`). Each row gives the GB/s of logits read once. --layouts also times the Gumbel kernels at other
chunk layouts and warp counts (QUARTER logits a lane block, four quarters a program) and says whether their tokens
are the reference's of the same layout (batches up to 64; the reference is slow beyond). CUDA only. JSON with
device, date, commit and command.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from provenance import save, stamp  # noqa: E402


def _ops(x: torch.Tensor, idx: torch.Tensor, gen: torch.Generator) -> dict:
    import torch.nn.functional as F

    from minite.rollout.decode import sample
    from minite.strict import ops as strict_ops
    vocab = x.shape[1]
    return {"megatron": lambda: sample(x, 1.0, 1.0, gen, vocab, sampler="megatron"),
            "gumbel": lambda: sample(x, 1.0, 1.0, gen, vocab, sampler="gumbel"),
            "megatron_t0.7": lambda: sample(x, 0.7, 1.0, gen, vocab, sampler="megatron"),
            "gumbel_t0.7": lambda: sample(x, 0.7, 1.0, gen, vocab, sampler="gumbel"),
            "default_log_softmax": lambda: torch.gather(F.log_softmax(x.unsqueeze(1), dim=-1), 2, idx.view(-1, 1, 1)),
            "strict_token_log_softmax": lambda: strict_ops.token_log_softmax(x, idx)}


def _layout(x: torch.Tensor, quarter: int, warps: int):
    """The Gumbel kernels at another layout (a launch function), and whether their tokens are the reference's of that
    layout (None past 64 rows)."""
    from minite.kernels.gumbel_sample import gumbel_sample_triton
    from minite.rollout.sampling import gumbel_sample_reference
    seed = torch.tensor([12345], device=x.device)

    def launch():
        return gumbel_sample_triton(x, seed, 1.0, x.shape[1], quarter=quarter, num_warps=warps)
    if x.shape[0] > 64:
        return launch, None
    return launch, torch.equal(launch(), gumbel_sample_reference(x, 12345, 1.0, x.shape[1], quarter=quarter))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rounds", type=int, default=2, help="times each op is timed, one after the other")
    p.add_argument("--layouts", default="", help="QUARTER:WARPS comma-separated: the Gumbel kernels at those layouts")
    a = p.parse_args(argv)
    layouts = [tuple(int(v) for v in s.split(":")) for s in a.layouts.split(",") if s]
    if not torch.cuda.is_available():
        print("bench_sampler: needs CUDA", file=sys.stderr)
        return 2
    import triton
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        x = torch.randn(batch, a.vocab, device="cuda") * 3
        idx = torch.randint(0, a.vocab, (batch,), device="cuda")
        timed = {name: (f, None) for name, f in _ops(x, idx, torch.Generator(device="cuda").manual_seed(0)).items()}
        timed.update({f"gumbel_layout_{q}x{w}": _layout(x, q, w) for q, w in layouts})
        for name, (f, equal) in timed.items():
            for r in range(a.rounds):
                us = triton.testing.do_bench(f, warmup=30, rep=200, return_mode="median") * 1e3
                rows.append({"batch": batch, "vocab": a.vocab, "op": name, "round": r, "us": us,
                             "logits_gb_per_s": batch * a.vocab * 4 / us / 1e3,
                             **({} if equal is None else {"tokens_equal_reference": equal})})
                print(f"batch {batch:4d} {name:26s} round {r}: {us:8.1f} us ({rows[-1]['logits_gb_per_s']:6.0f} GB/s)"
                      + ("" if equal is None else f" tokens = reference: {equal}"), flush=True)
    save({"device": "1x " + torch.cuda.get_device_name(), **stamp(), "torch": torch.__version__, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
