"""The rollout's decode GEMMs for bench_nvfp4.py (sections rollout_gemm and rollout_dense): the experts' FC1/FC2 and
the dense linears of one decode step of the rollout slice, BF16 against W4A4 tiles, each tile checked bitwise against
the training tile."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from minite.kernels.nvfp4_gemm import GemmConfig, grouped_gemm_triton, stack_expert_weights
from minite.kernels.nvfp4_quant import quantize_triton, quantize_with_values_triton
from timing import bench_graph, log  # tools/bench/, beside this script

HIDDEN, FFN, EXPERTS, TOPK = 2048, 768, 128, 8


# ---------------------------------------------------------------- rollout_gemm
ROLLOUT_TILES = [GemmConfig(*c) for c in (  # the first is FC2's default below 9 rows per expert, the 4th FC1's
    (16, 64, 128, 4, 4, True), (16, 128, 128, 4, 4, True), (16, 128, 128, 8, 4, True), (16, 64, 256, 4, 3, True),
    (16, 128, 256, 8, 3, True), (32, 64, 128, 4, 4, True), (16, 64, 128, 4, 4), (32, 128, 128, 4, 3, True))]


def section_rollout_gemm(res: dict, batches=(1, 8, 64, 256)) -> None:
    """The expert GEMMs of a decode step of the rollout slice (128 experts, top-8 of `batch` tokens): BF16 _grouped_mm,
    W4A4 on fp16 block values, packed weights (Triton / PTX decode; the decode order with fp16 scales, and on one tile
    with its scale bytes), every W4A4 tile checked bitwise against the training tile. Eight routings per timed graph:
    the experts read differ between calls (the 8-expert case would fit the 50 MB L2 otherwise)."""
    from minite.kernels import nvfp4_gemm as ng
    sets = 8
    out = res.setdefault("rollout_gemm_us", {})
    for fc, (n, k) in {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}.items():
        g = torch.Generator(device="cuda").manual_seed(7)
        wb = (torch.randn(EXPERTS, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        qs = [quantize_triton(wb[e], (16, 16), "tensor", "nearest", None, False) for e in range(EXPERTS)]
        packed = stack_expert_weights(qs)
        values = stack_expert_weights(qs, values=True)
        ordered = stack_expert_weights(qs, decode=True)
        wt = wb.transpose(1, 2)  # [E, K, N] view for torch._grouped_mm
        for b in batches:
            rows = b * TOPK
            cnts = []
            for _ in range(sets):
                ex = torch.rand(b, EXPERTS, device="cuda", generator=g).topk(TOPK, dim=1).indices.reshape(-1)
                cnts.append(torch.bincount(ex, minlength=EXPERTS).to(torch.int32))
            xs = [torch.randn(rows, k, device="cuda", generator=g).bfloat16() for _ in range(sets)]
            qa = [quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False) for x in xs]
            offs = [c.cumsum(0, dtype=torch.int32) for c in cnts]
            row = out.setdefault(fc, {}).setdefault(str(b), {})
            row["bf16_grouped_mm"] = 1e3 * bench_graph(
                lambda: [torch._grouped_mm(xs[i], wt, offs=offs[i]) for i in range(sets)], sets)
            ref = grouped_gemm_triton(qa[0][0], values, cnts[0], torch.bfloat16, a_values=qa[0][1],
                                      config=GemmConfig(128, 128, 64, 8, 4))
            row["w4a4_values_default"] = 1e3 * bench_graph(
                lambda: [grouped_gemm_triton(qa[i][0], values, cnts[i], torch.bfloat16, a_values=qa[i][1],
                                             rows_hint=max(1, rows // EXPERTS)) for i in range(sets)], sets)
            best = None
            variants = [("triton", packed, c) for c in ROLLOUT_TILES[:2]] \
                + [(v, w, c) for v, w in (("ptx", packed), ("ptx_decode_order", ordered)) for c in ROLLOUT_TILES] \
                + [("ptx_decode_order_u8_scales", dataclasses.replace(ordered, decode_scale=None), ROLLOUT_TILES[0])]
            for name, wts, c in variants:
                ng.PTX_DECODE = name != "triton"
                key = (f"packed_{name}_{c.block_m}x{c.block_n}x{c.block_k}_w{c.num_warps}s{c.num_stages}"
                       f"{'_swap' * c.swap_ab}")

                def run(i, wts=wts, c=c):
                    return grouped_gemm_triton(qa[i][0], wts, cnts[i], torch.bfloat16, a_values=qa[i][1], config=c)
                try:
                    same = torch.equal(run(0), ref)
                    t = 1e3 * bench_graph(lambda: [run(i) for i in range(sets)], sets)
                except Exception as exc:
                    log(f"  rollout_gemm {fc} b{b} {key} failed: {type(exc).__name__}: {str(exc)[-600:]}")
                    continue
                row[key] = t if same else None
                if not same:
                    log(f"  rollout_gemm {fc} b{b} {key}: NOT bitwise equal to the training tile")
                elif best is None or t < best[1]:
                    best = (key, t)
            ng.PTX_DECODE = True
            log(f"  rollout_gemm {fc} b{b} all (us): " + ", ".join(
                f"{kk[7:]} {'%.1f' % v if v else 'NOT-BITWISE'}" for kk, v in row.items() if kk.startswith("packed_")))
            if best:
                row["best_packed"] = best[0]
            log(f"rollout_gemm {fc} b{b:3d}: bf16 {row['bf16_grouped_mm']:6.1f} us  values "
                f"{row['w4a4_values_default']:6.1f}"
                f" us  best packed {best[1] if best else float('nan'):6.1f} us ({best[0] if best else '-'})")


DENSE_TILES = [GemmConfig(*c) for c in (  # rollout_dense candidates beside default_config's choice
    (16, 64, 128, 4, 4, True), (16, 64, 256, 4, 3, True), (32, 64, 128, 4, 4, True), (32, 128, 128, 4, 3, True),
    (64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 256, 4, 3), (32, 32, 128, 4, 4))]
DENSE_SHAPES = {"qkv": (5120, HIDDEN), "proj": (HIDDEN, 4096)}  # N, K of the slice's dense NVFP4 linears


def section_rollout_dense(res: dict, batches=(1, 8, 64, 256)) -> None:
    """The dense NVFP4 linears of a decode step (QKV 2048 -> 5120, output projection 4096 -> 2048) at batch 1, 8,
    64, 256: cuBLAS BF16 vs W4A4 at default_config's tile on fp16 block-value weights (what ships) vs other tiles,
    values and packed weights in the decode order, each checked bitwise against the training tile. 32 weight sets
    per timed graph, so that even the packed ones (4-6 MB a set) stream from HBM as in a decode step, not from the
    50-60 MB L2."""
    sets = 32
    out = res.setdefault("rollout_dense_us", {})
    for name, (n, k) in DENSE_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(11)
        wb = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16() for _ in range(sets)]
        qs = [quantize_triton(w, (16, 16), "tensor", "nearest", None, False) for w in wb]
        values = [stack_expert_weights([q], values=True) for q in qs]
        ordered = [stack_expert_weights([q], decode=True) for q in qs]
        for b in batches:
            xs = [torch.randn(b, k, device="cuda", generator=g).bfloat16() for _ in range(sets)]
            qa = [quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False) for x in xs]
            cnt = torch.full((1,), b, dtype=torch.int32, device="cuda")
            row = out.setdefault(name, {}).setdefault(str(b), {})
            row["bf16_linear"] = 1e3 * bench_graph(lambda: [F.linear(xs[i], wb[i]) for i in range(sets)], sets)
            ref = grouped_gemm_triton(qa[0][0], values[0], cnt, torch.bfloat16, a_values=qa[0][1],
                                      config=GemmConfig(128, 256, 64, 8, 3))
            variants = [("values_default", values, None)] + [("values", values, c) for c in DENSE_TILES] \
                + [("packed_decode_order", ordered, c) for c in DENSE_TILES]
            best = None
            for vname, wts, c in variants:
                key = vname if c is None else (f"{vname}_{c.block_m}x{c.block_n}x{c.block_k}_w{c.num_warps}"
                                               f"s{c.num_stages}{'_swap' * c.swap_ab}")

                def run(i, wts=wts, c=c):
                    return grouped_gemm_triton(qa[i][0], wts[i], cnt, torch.bfloat16, a_values=qa[i][1], config=c,
                                               rows_hint=b)
                try:
                    same = torch.equal(run(0), ref)
                    t = 1e3 * bench_graph(lambda: [run(i) for i in range(sets)], sets)
                except Exception as exc:
                    log(f"  rollout_dense {name} b{b} {key} failed: {type(exc).__name__}: {str(exc)[-400:]}")
                    continue
                row[key] = t if same else None
                if not same:
                    log(f"  rollout_dense {name} b{b} {key}: NOT bitwise equal to the training tile")
                elif best is None or t < best[1]:
                    best = (key, t)
            row["best"] = best[0] if best else None
            log(f"rollout_dense {name} b{b:3d}: bf16 {row['bf16_linear']:6.1f} us, shipped "
                f"{row.get('values_default') or float('nan'):6.1f} us, best {best[1] if best else float('nan'):6.1f}"
                f" us ({best[0] if best else '-'}); all: " + ", ".join(
                    f"{kk} {'%.1f' % v if v else 'NOT-BITWISE'}" for kk, v in row.items()
                    if kk not in ("bf16_linear", "best")))
