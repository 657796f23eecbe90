"""Strict mode's fixed-K BF16 GEMM (minite/strict/triton_gemm.py) at the lm_head's shapes, over its tile.

    python tools/bench/sweep_fixed_k.py --out /tmp/fixed-k.json [--rows 1,8,64,256,2048]
        [--shapes M:N:K,...] [--tiles BM:BN:WARPS:STAGES,...]

For bf16 x [rows, 2048] and w [151936, 2048] (the rollout slice's hidden size and Qwen3's vocabulary; --shapes: other
[M, K] x [N, K] products, e.g. the QKV's 5120:2048 and the output projection's 2048:4096), each tile
(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES; BLOCK_K stays 64, the K order) is timed by CUDA-graph replays
(triton.testing.do_bench_cudagraph, rep=60) and its output compared bit for bit with the shipped tile's, and with
cuBLAS's time for the same product (torch.matmul, bf16 out) beside it. Whether a tile changes a row's bits is what the
comparison measures: strict mode may pick the tile by the number of rows only where it does not. CUDA only. JSON
with device, date, commit and command.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minite.strict import triton_gemm as TG  # noqa: E402
from provenance import save, stamp  # noqa: E402

TILES = ((64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 4, 3), (128, 128, 8, 3),
         (128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3), (32, 128, 4, 4), (16, 64, 4, 4), (16, 128, 4, 4))
"""(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)."""


def sweep(shapes, tiles=TILES) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    shipped = TG.TILES
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    try:
        for m, n, k in shapes:
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            cublas = 1000 * do_bench_cudagraph(lambda: torch.matmul(x, w.t()), rep=60)
            TG.TILES = (TG.Tile(64, 64, 4, 3),)  # the tile of every strict row before tiles by shape
            ref = TG.matmul_fixed_k(x, w)
            for bm, bn, warps, stages in tiles:
                TG.TILES = (TG.Tile(bm, bn, warps, stages),)
                try:
                    same = bool(torch.equal(TG.matmul_fixed_k(x, w).view(torch.int32), ref.view(torch.int32)))
                    us = 1000 * do_bench_cudagraph(lambda: TG.matmul_fixed_k(x, w), rep=60)
                except Exception as e:  # a tile the device cannot hold (shared memory): reported, not fatal
                    print(f"rows {m:5d} tile {bm}x{bn} w{warps} s{stages}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                shipped_tile = bool(TG.Tile(bm, bn, warps, stages) == _picked(shipped, m, n))
                out.append(dict(rows=m, n=n, k=k, block_m=bm, block_n=bn, warps=warps, stages=stages, us=us,
                                cublas_us=cublas, bitwise=same, picked=shipped_tile))
                print(f"{m:5d} x {n:6d} x {k:4d} tile {bm:3d}x{bn:3d} w{warps} s{stages}: {us:8.1f} us (cuBLAS "
                      f"{cublas:7.1f})  bitwise={same}{'  <- tile() picks it' if shipped_tile else ''}", flush=True)
            del ref, w
    finally:
        TG.TILES = shipped
    return out


def _picked(tiles, m, n):
    saved, TG.TILES = TG.TILES, tiles
    try:
        return TG.tile(m, n)
    finally:
        TG.TILES = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON to write (docs/benchmarks/fixed-k-sweep-h100.json holds rows of "
                   "several runs merged by hand, each with its commit: do not overwrite it)")
    p.add_argument("--rows", default="1,8,64,256,2048", help="rows of the lm_head's shape (N 151936, K 2048)")
    p.add_argument("--shapes", default="", help="more shapes, M:N:K comma-separated")
    p.add_argument("--tiles", default="", help="tiles instead of TILES above, BM:BN:WARPS:STAGES comma-separated")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_fixed_k: needs CUDA", file=sys.stderr)
        return 2
    shapes = [(int(r), 151936, 2048) for r in a.rows.split(",") if r]
    shapes += [tuple(int(v) for v in sh.split(":")) for sh in a.shapes.split(",") if sh]
    tiles = tuple(tuple(int(v) for v in t.split(":")) for t in a.tiles.split(",") if t) or TILES
    rows = sweep(shapes, tiles)
    save({"device": "1x " + torch.cuda.get_device_name(), **stamp(), "torch": torch.__version__, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
