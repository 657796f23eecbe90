"""The MoE wgrad of a step with gradient accumulation on the H200 (kernels/nvfp4_wgrad.py): the learner slice's expert
wgrads (128 experts, top-8 of 4096-token micro-batches: 32768 token rows each) added into an fp32 main_grad, P
micro-batches at a time.

    python tools/bench/bench_wgrad.py [--passes 8] [--out docs/benchmarks/wgrad-h200.json]

Per GEMM (fc1: dy^T 1536 rows, x^T 2048; fc2: dy^T 2048, a^T 768), with random counts and operands quantised as the
learner quantises them (packed codes; values written as the learner writes them):
  immediate   P launches of the one-pass accumulating GEMM (`segmented_gemm_triton(accumulate=)`) on fp16 block values
              already written, as each micro-batch's backward ran it before the deferral
  passes      `segmented_gemm_passes_triton` at each candidate tile (what the deferral's flush runs: the passes'
              codes laid side by side, their block values written, one multi-pass GEMM)
The passes' main_grad is compared bitwise with the immediate one at every tile (every tile computes the same bits:
the K order is fixed). Medians of triton.testing.do_bench; one table printed last; JSON with device, date, commit
and command.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minite.kernels import nvfp4_wgrad as nw  # noqa: E402
from minite.kernels.nvfp4_gemm import GemmConfig  # noqa: E402
from minite.nvfp4 import quantize_count_segments  # noqa: E402
from provenance import emit, stamp  # noqa: E402  (tools/bench/, beside this script)

EXPERTS, TOKENS, TOPK = 128, 4096, 8
GEMMS = {"fc1": (1536, 2048), "fc2": (2048, 768)}  # rows of dy^T and of the input^T
TILES = [GemmConfig(64, 256, 64, 8, 3), GemmConfig(64, 256, 64, 8, 4), GemmConfig(64, 256, 128, 8, 2),
         GemmConfig(128, 64, 64, 4, 3), GemmConfig(64, 128, 64, 4, 3), GemmConfig(128, 128, 64, 8, 3)]


def _pass(rows_a: int, rows_b: int, gen: torch.Generator):
    """One micro-batch's packed segment operands (dy^T, input^T) on random routing."""
    t = TOKENS * TOPK
    expert = torch.randint(0, EXPERTS, (t,), generator=gen, device="cuda")
    counts = torch.bincount(expert, minlength=EXPERTS).to(torch.int32)
    dy = (torch.randn(t, rows_a, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
    x = torch.randn(t, rows_b, generator=gen, device="cuda").to(torch.bfloat16)
    seeds = torch.randint(0, 2**31, (EXPERTS,), generator=gen, device="cuda").cpu().numpy()
    gs = quantize_count_segments(dy.t(), counts, rounding="stochastic", seeds=seeds, rht=True, backend="triton")
    xs = quantize_count_segments(x.t(), counts, rounding="nearest", rht=True, backend="triton")
    return gs, xs


def run(passes: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (ra, rb) in GEMMS.items():
        ops = [_pass(ra, rb, gen) for _ in range(passes)]
        valued = [(dataclasses.replace(gs).with_values("triton"), dataclasses.replace(xs).with_values("triton"))
                  for gs, xs in ops]
        want = torch.zeros(EXPERTS, ra, rb, dtype=torch.float32, device="cuda")
        main = torch.zeros_like(want)

        def immediate():
            for gs, xs in valued:
                nw.segmented_gemm_triton(gs, xs, accumulate=main)

        immediate()
        want.copy_(main)
        row = {"gemm": name, "rows_a": ra, "rows_b": rb, "passes": passes, "experts": EXPERTS,
               "tokens_per_pass": TOKENS * TOPK, "immediate_ms": do_bench(immediate, return_mode="median"),
               "tiles": []}
        for cfg in TILES:
            nw.PASSES_TILE = cfg
            main.zero_()
            try:
                nw.segmented_gemm_passes_triton([g for g, _ in ops], [x for _, x in ops], main)
            except Exception as e:  # a tile that does not compile (resources) is reported, not fatal
                row["tiles"].append({"tile": list(vars(cfg).values()), "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            same = torch.equal(main.view(torch.int32), want.view(torch.int32))
            ms = do_bench(lambda: nw.segmented_gemm_passes_triton([g for g, _ in ops], [x for _, x in ops], main),
                          return_mode="median")
            row["tiles"].append({"tile": list(vars(cfg).values()), "passes_ms": ms, "bitwise_vs_immediate": same})
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = run(a.passes)
    print(f"MoE wgrad into fp32 main_grad, {a.passes} micro-batches of {TOKENS * TOPK} token rows, {EXPERTS} "
          "experts (ms)")
    for r in rows:
        for t in r["tiles"]:
            got = t.get("error") or (f"{t['passes_ms']:7.2f}  {r['immediate_ms'] / t['passes_ms']:5.2f}x  bitwise "
                                     f"{t['bitwise_vs_immediate']}")
            print(f"  {r['gemm']} immediate {r['immediate_ms']:7.2f} | passes tile {t['tile']}: {got}")
    result = {"rows": rows, "device": torch.cuda.get_device_name(), **stamp()}
    emit(result, a.out)


if __name__ == "__main__":
    main()
