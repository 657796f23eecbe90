"""Strict mode's fused attention (minite/strict/fused_attention.py) at decode shapes, over its key block and warps.

    python tools/bench/sweep_strict_attention.py [--out docs/benchmarks/strict-attention-sweep-h100.json]

For bf16 q [1, batch, 32, 128] and k/v [keys, batch, 4, 128] (the rollout slice's heads at one decode step), each
(ATTENTION_KEY_BLOCK, ATTENTION_WARPS) is timed by CUDA-graph replays (triton.testing.do_bench_cudagraph, rep=60)
and its output compared bit for bit with the shipped configuration's. The key block changes no bit by construction
(the pair tree over the padded keys is the tree over aligned blocks of any power of two, then over the block sums);
the comparison proves it on the device. CUDA only. JSON with device, date, commit and command.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minite.strict import fused_attention as FA  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = ((256, 72), (256, 56), (64, 72), (64, 56), (8, 56))  # (batch, keys)


def sweep(key_blocks=(8, 16, 32, 64), warps=(1, 2)) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    shipped = FA.ATTENTION_KEY_BLOCK, FA.ATTENTION_WARPS
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    try:
        for batch, keys in SHAPES:
            q = torch.randn(1, batch, 32, 128, device="cuda", generator=g).bfloat16()
            k, v = (torch.randn(keys, batch, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
            FA.ATTENTION_KEY_BLOCK, FA.ATTENTION_WARPS = shipped
            ref = FA.attention(q, k, v, 0.088)
            for kb in key_blocks:
                for w in warps:
                    FA.ATTENTION_KEY_BLOCK, FA.ATTENTION_WARPS = kb, w
                    same = bool(torch.equal(FA.attention(q, k, v, 0.088).view(torch.int32), ref.view(torch.int32)))
                    us = 1000 * do_bench_cudagraph(lambda: FA.attention(q, k, v, 0.088), rep=60)
                    rows.append(dict(batch=batch, keys=keys, key_block=kb, warps=w, us=us, bitwise=same))
                    print(f"b {batch:3d} keys {keys:3d} KB {kb:2d} warps {w}: {us:7.1f} us  bitwise={same}",
                          flush=True)
    finally:
        FA.ATTENTION_KEY_BLOCK, FA.ATTENTION_WARPS = shipped
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/benchmarks/strict-attention-sweep-h100.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_strict_attention: needs CUDA", file=sys.stderr)
        return 2
    import json

    rows = sweep()
    out = {"device": "1x " + torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc)
           .strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(), "torch": torch.__version__,
           "command": "tools/bench/sweep_strict_attention.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
