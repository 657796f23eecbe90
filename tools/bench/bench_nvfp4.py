"""H200 benchmarks of the NVFP4 kernels (issue 4), one run, one device, ratios measured in the same process.

    python tools/bench/bench_nvfp4.py --out docs/benchmarks/kernels-h200.json [--sections copy,quant,block,decode]

Sections:
- copy:   device-to-device copy of 131072 x 2048 bf16 (bytes read + written) -> copy_TBps, the ceiling for quant.
- quant:  quantisation of the same activations (1x16, per-row scale, RNE): (bytes read + written) / time as a
          fraction of the copy rate; also per-tensor scale (two passes, or one with the amax given), 16x16 blocks,
          block-value output, wgrad RHT+SR variants.
- block:  Qwen3-30B-A3B expert block (128 experts, top-8, hidden 2048, ffn 768, 16384 tokens -> 131072 permuted rows):
          bf16 permuted input -> FC1 -> SwiGLU -> FC2 -> bf16, W4A4 kernels vs torch._grouped_mm BF16 (fwd, fwd+bwd),
          and vs an NVFP4 emulation in plain torch ops (minite.nvfp4's reference quantiser + bf16 _grouped_mm).
- decode: 8 active experts' FC1 (2048 -> 1536) for M in {1, 4, 16, 32} tokens each, W4A4 (per-row activation
          quantisation + packed-weight grouped GEMM, decode tiles) vs torch.bmm on bf16 weights. Both CUDA graph
          replays over 8 rotating weight sets (one set's bf16 weights fit in the 60 MB L2; rotating reads HBM).
- rollout_gemm: the expert GEMMs (FC1, FC2) of one decode step of the rollout slice at batch 1, 8, 64, 256 (128
          experts, top-8): BF16 torch._grouped_mm vs W4A4 on fp16 block-value weights vs packed weights (Triton and
          PTX nibble decodes, the decode order; a sweep of tiles, each checked bitwise against the training tile).
- rollout_dense: the slice's dense NVFP4 linears (QKV, output projection) at batch 1, 8, 64, 256: BF16 F.linear vs
          W4A4 at the shipped tile vs other tiles, on block values and on packed weights in the decode order.
Timing: triton.testing.do_bench medians (events), after warm-up; every number in the JSON comes from this run.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from minite.kernels.expert_swiglu import expert_swiglu_backward_triton
from minite.kernels.nvfp4_swiglu import SwiGLUFunction, swiglu_bwd_triton, swiglu_quant_triton
from minite.kernels.nvfp4_gemm import ExpertWeights, GemmConfig, grouped_gemm_triton, stack_expert_weights
from minite.kernels import nvfp4_quant as nq, nvfp4_segments as ns, nvfp4_wgrad as nw
from minite.kernels.nvfp4_quant import quantize_triton, quantize_with_values_triton
from minite.nvfp4.grouped import stack_amax
from minite.ops.common import abs_max
from provenance import stamp  # tools/bench/, beside this script
from rollout_gemms import section_rollout_dense, section_rollout_gemm
from timing import LOG, bench, bench_graph, log

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 2048, 768, 128, 8, 16384
SWEEP = True  # --no-sweep: measure the shipped tiles (kernels/nvfp4_quant.py TUNING) only


# ---------------------------------------------------------------- copy + quant
def section_copy_quant(res: dict) -> None:
    rows, cols = TOKENS * TOPK, HIDDEN
    x, y = torch.randn(2, rows, cols, device="cuda").bfloat16().unbind(0)  # y: the copy's destination
    t = bench(lambda: y.copy_(x))
    n = rows * cols
    copy_bps = 2 * n * 2 / (t * 1e-3)
    res["copy_TBps"] = copy_bps / 1e12
    log(f"copy 131072x2048 bf16: {t * 1e3:.1f} us, {copy_bps / 1e12:.3f} TB/s")
    out_bytes, blocks2d = n // 2 + n // 16, 2 * n + n // 2 + n // 256  # blocks2d: 16x16 blocks, bf16 read
    if SWEEP:  # the tile sweeps; without them every number below is the shipped tiles' (--no-sweep)
        # tuning sweep (every setting gives the same bits): per-row activations, codes only and codes + fp16 values
        for kind, values in (("plain", False), ("values", True)):
            best = None
            for vec2d in (True, False):
                for elems, warps in ((e, w) for e in (1024, 2048, 4096) for w in (1, 2)):
                    nq.TUNING[kind] = {"elems": elems, "warps": warps, "vec2d": vec2d}
                    fn = (lambda: quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)) if values \
                        else (lambda: quantize_triton(x, (1, 16), "row", "nearest", None, False))
                    t = bench(fn, rep=60)
                    log(f"  quant sweep {kind} vec2d={vec2d} elems={elems} warps={warps}: {t * 1e3:.1f} us")
                    if best is None or t < best[0]:
                        best = (t, dict(nq.TUNING[kind]))
            nq.TUNING[kind] = best[1]
        # transposed views (the wgrad operands dy^T, x^T: tensor scope, RHT, codes + fp16 values, as the backward
        # quantises them): the shipped tile first, then the sweep; every setting must give the shipped tile's bits
        fn = lambda: quantize_with_values_triton(x.t(), (1, 16), "tensor", "stochastic", 7, True)  # noqa: E731
        shipped = dict(nq.TUNING["colmajor"])
        q0, v0 = fn()
        best_cm = (bench(fn, rep=60), shipped)
        log(f"  quant sweep colmajor (values) shipped {shipped}: {best_cm[0] * 1e3:.1f} us")
        sweep = [{"elems": 8192, "warps": 8, "vec2d": False, "rows": 128}]  # the default before 2026-12-01
        sweep += [{"elems": n, "warps": wp, "vec2d": True, "rows": r}
                  for r in (16, 32, 64) for n in (2048, 4096, 8192) for wp in (4, 8)]
        res["colmajor_sweep_us"] = []
        for tu in sweep:
            nq.TUNING["colmajor"] = tu
            q, v = fn()
            same = q.equal(q0) and torch.equal(v, v0)
            t = bench(fn, rep=60)
            res["colmajor_sweep_us"].append({**tu, "us": t * 1e3, "bitwise": same})
            log(f"  quant sweep colmajor (values) {tu}: {t * 1e3:.1f} us bitwise={same}")
            if same and t < best_cm[0]:
                best_cm = (t, tu)
        nq.TUNING["colmajor"] = best_cm[1]
    res["quant_tuning"] = {k: dict(v) for k, v in nq.TUNING.items()}
    log(f"quant tuning chosen: {res['quant_tuning']}")
    q, amax, one = quantize_triton, x.abs().amax().float(), 2 * n + out_bytes  # one: bf16 read, codes + scales
    variants = {  # amax_given: one pass, as the learner's dgrad operands run (their amax from the pass before them)
        "row_rne": (lambda: q(x, (1, 16), "row", "nearest", None, False), one + 4 * rows),
        "row_rne_values_fp16": (lambda: quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False),
                                one + 4 * rows + 2 * n),
        "tensor_rne": (lambda: q(x, (1, 16), "tensor", "nearest", None, False), one),
        "tensor_sr": (lambda: q(x, (1, 16), "tensor", "stochastic", 7, False), one),
        "tensor_rne_amax_given": (lambda: q(x, (1, 16), "tensor", "nearest", None, False, amax), one),
        "tensor_sr_amax_given": (lambda: q(x, (1, 16), "tensor", "stochastic", 7, False, amax), one),
        "2d_weightlike": (lambda: q(x, (16, 16), "tensor", "nearest", None, False), blocks2d),
        "2d_weightlike_amax_given": (lambda: q(x, (16, 16), "tensor", "nearest", None, False, amax), blocks2d),
        "colwise_rht_sr": (lambda: q(x.t(), (1, 16), "tensor", "stochastic", 7, True), one),
    }
    res["quant_variants"] = {}
    for name, (fn, nbytes) in variants.items():
        t = bench(fn)
        frac = nbytes / (t * 1e-3) / copy_bps
        res["quant_variants"][name] = {"us": t * 1e3, "fraction_of_copy": frac}
        log(f"quant {name:22s}: {t * 1e3:8.1f} us  {nbytes / (t * 1e-3) / 1e12:.3f} TB/s  {frac:.3f} of copy")
    res["quant_fraction_of_copy"] = res["quant_variants"]["row_rne"]["fraction_of_copy"]
    res["quant_fraction_of_copy_note"] = ("activation recipe: 1x16 blocks, per-row global scale, RNE, one pass; "
                                          "bytes = bf16 read + codes + scales + row scales written")


# ---------------------------------------------------------------- expert block
def _routing_counts(rows: int, experts: int, gen) -> torch.Tensor:
    """Token counts per expert, multiples of 16 (the wgrad operands' blocks must not straddle experts)."""
    units = rows // 16
    probs = torch.rand(experts, generator=gen) + 0.5
    c = torch.multinomial(probs, units, replacement=True, generator=gen)
    return (torch.bincount(c, minlength=experts) * 16).to(torch.int32)


def _quant_weights(w_bf16: torch.Tensor, transpose_too: bool):
    """Per expert: 16x16-block weights (as in the recipe); stacked packed + fp16 values, and the transposes."""
    qs = [quantize_triton(w, (16, 16), "tensor", "nearest", None, False) for w in w_bf16]
    fwd = stack_expert_weights(qs, values=True)
    bwd = stack_expert_weights([q.t() for q in qs], values=True) if transpose_too else None
    return qs, fwd, bwd


def section_block(res: dict, train_cfg: GemmConfig | None) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = TOKENS * TOPK
    counts = _routing_counts(rows, EXPERTS, gen).cuda()
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = (torch.randn(rows, HIDDEN, device="cuda") * 0.5).bfloat16()
    w1 = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda") * HIDDEN ** -0.5).bfloat16()  # [E, N, K]
    w2 = (torch.randn(EXPERTS, HIDDEN, FFN, device="cuda") * FFN ** -0.5).bfloat16()
    dy = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    flops_fwd = 2 * rows * HIDDEN * 2 * FFN + 2 * rows * FFN * HIDDEN

    # BF16: torch._grouped_mm (weights [E, N, K], so b = w.transpose(1, 2)); SwiGLU either eager torch ops or the
    # same Triton elementwise kernels the W4A4 path uses (the headline baseline: only the precision differs)
    def bf16_fwd(xx, a1, a2, eager_swiglu=False):
        h = torch._grouped_mm(xx, a1.transpose(1, 2), offs=offs)
        a = F.silu(h[:, :FFN]) * h[:, FFN:] if eager_swiglu else SwiGLUFunction.apply(h)
        return torch._grouped_mm(a, a2.transpose(1, 2), offs=offs)

    xg, w1g, w2g = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()

    def bf16_fwdbwd(eager_swiglu=False):
        y = bf16_fwd(xg, w1g, w2g, eager_swiglu)
        torch.autograd.backward(y, dy)
        xg.grad = w1g.grad = w2g.grad = None

    t_bf16_fwd = bench(lambda: bf16_fwd(x, w1, w2))
    t_bf16_fb = bench(bf16_fwdbwd, rep=300)
    t_bf16_fwd_eager = bench(lambda: bf16_fwd(x, w1, w2, True))
    t_bf16_fb_eager = bench(lambda: bf16_fwdbwd(True), rep=300)
    log(f"block BF16 fwd {t_bf16_fwd:.3f} ms ({flops_fwd / t_bf16_fwd / 1e9:.0f} TFLOP/s), fwd+bwd {t_bf16_fb:.3f} ms"
        f" (eager torch SwiGLU: fwd {t_bf16_fwd_eager:.3f}, fwd+bwd {t_bf16_fb_eager:.3f})")

    q1, w1s, w1t = _quant_weights(w1, True)
    q2, w2s, w2t = _quant_weights(w2, True)
    cfg = train_cfg

    def w4_fwd(keep=False):
        qx, xv = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
        h = grouped_gemm_triton(qx, w1s, counts, torch.bfloat16, a_values=xv, config=cfg)
        a, qa, av = swiglu_quant_triton(h)  # SwiGLU + per-row quantisation of its output, one pass
        y = grouped_gemm_triton(qa, w2s, counts, torch.bfloat16, a_values=av, config=cfg)
        return (y, h, a) if keep else y

    def w4_fwdbwd():
        y, h, a = w4_fwd(keep=True)
        # dgrad FC2 and SwiGLU backward
        qd, dv = quantize_with_values_triton(dy, (1, 16), "tensor", "stochastic", 1, False)
        da = grouped_gemm_triton(qd, w2t, counts, torch.bfloat16, a_values=dv, config=cfg)
        dh = swiglu_bwd_triton(h, da)
        qh, hv = quantize_with_values_triton(dh, (1, 16), "tensor", "stochastic", 2, False)
        grouped_gemm_triton(qh, w1t, counts, torch.bfloat16, a_values=hv, config=cfg)  # dx
        # wgrad: operands along tokens, RHT (+ SR for gradients), grouped over K by expert
        qdyt, dytv = quantize_with_values_triton(dy.t(), (1, 16), "tensor", "stochastic", 3, True)
        qat, atv = quantize_with_values_triton(a.t(), (1, 16), "tensor", "nearest", None, True)
        nw.kgrouped_gemm_triton(qdyt, qat, counts, torch.bfloat16, a_values=dytv, b_values=atv)
        qdht, dhtv = quantize_with_values_triton(dh.t(), (1, 16), "tensor", "stochastic", 4, True)
        qxt, xtv = quantize_with_values_triton(x.t(), (1, 16), "tensor", "nearest", None, True)
        nw.kgrouped_gemm_triton(qdht, qxt, counts, torch.bfloat16, a_values=dhtv, b_values=xtv)

    t_w4_fwd = bench(w4_fwd)
    t_w4_fb = bench(w4_fwdbwd, rep=300)
    log(f"block W4A4 fwd {t_w4_fwd:.3f} ms, fwd+bwd {t_w4_fb:.3f} ms")

    # where the forward time goes (each stage alone)
    w1_packed = stack_expert_weights(q1)
    qx, xv = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    h = grouped_gemm_triton(qx, w1s, counts, torch.bfloat16, a_values=xv, config=cfg)
    a, qa, av = swiglu_quant_triton(h)
    stages = {
        "quant_x": bench(lambda: quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)),
        "fc1_w4a4": bench(lambda: grouped_gemm_triton(qx, w1s, counts, torch.bfloat16, a_values=xv, config=cfg)),
        "fc1_bf16_grouped_mm": bench(lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)),
        "swiglu_eager_torch": bench(lambda: F.silu(h[:, :FFN]) * h[:, FFN:]),
        "swiglu_triton": bench(lambda: swiglu_quant_triton(h, quantize=False)),
        "swiglu_fused_quant_a": bench(lambda: swiglu_quant_triton(h)),
        "quant_a_separate": bench(lambda: quantize_with_values_triton(a, (1, 16), "row", "nearest", None, False)),
        "fc2_w4a4": bench(lambda: grouped_gemm_triton(qa, w2s, counts, torch.bfloat16, a_values=av, config=cfg)),
        "fc2_bf16_grouped_mm": bench(lambda: torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)),
        "fc1_w4a4_packed_operands": bench(lambda: grouped_gemm_triton(qx, w1_packed, counts, torch.bfloat16,
                                                                      config=cfg)),
    }
    for k, v in stages.items():
        log(f"  stage {k:26s} {v * 1e3:8.1f} us")

    # where the backward time goes
    _, h_, a_ = w4_fwd(keep=True)
    qd, dv = quantize_with_values_triton(dy, (1, 16), "tensor", "stochastic", 1, False)
    da = grouped_gemm_triton(qd, w2t, counts, torch.bfloat16, a_values=dv, config=cfg)
    dh = torch.cat([da, da], 1)
    qdyt, dytv = quantize_with_values_triton(dy.t(), (1, 16), "tensor", "stochastic", 3, True)
    qat, atv = quantize_with_values_triton(a_.t(), (1, 16), "tensor", "nearest", None, True)

    main_grad = torch.zeros(EXPERTS, dy.shape[1], a_.shape[1], dtype=torch.float32, device="cuda")
    dy_amax, probs = abs_max(dy), torch.rand(rows, device="cuda")

    bwd_stages = {
        "quant_dy_sr": bench(lambda: quantize_with_values_triton(dy, (1, 16), "tensor", "stochastic", 1, False)),
        "dgrad_fc2": bench(lambda: grouped_gemm_triton(qd, w2t, counts, torch.bfloat16, a_values=dv, config=cfg)),
        "swiglu_bwd_triton": bench(lambda: swiglu_bwd_triton(h_, da)),
        "quant_dyT_rht_sr": bench(lambda: quantize_with_values_triton(dy.t(), (1, 16), "tensor", "stochastic", 3,
                                                                      True)),
        "quant_aT_rht": bench(lambda: quantize_with_values_triton(a_.t(), (1, 16), "tensor", "nearest", None, True)),
        "wgrad_fc2": bench(lambda: nw.kgrouped_gemm_triton(qdyt, qat, counts, torch.bfloat16, a_values=dytv,
                                                        b_values=atv)),
        "bf16_fc2_wgrad_equiv_grouped_mm": bench(lambda: torch._grouped_mm(dy.t(), a_, offs=offs)),
        # the learner's wgrad adds into the fp32 main_grad (minite.ops.grouped._main_grad); BF16's: grouped_mm, add_
        "wgrad_fc2_accumulate": bench(lambda: nw.kgrouped_gemm_triton(qdyt, qat, counts, a_values=dytv, b_values=atv,
                                                                   accumulate=main_grad)),
        "bf16_fc2_wgrad_grouped_mm_then_add": bench(lambda: main_grad.add_(torch._grouped_mm(dy.t(), a_, offs=offs))),
        # the learner's dgrad operands' amax from the pass before (ops.common.hint_amax; FC2's: the tokens' gradient)
        "quant_dy_sr_given_amax": bench(lambda: quantize_with_values_triton(dy, (1, 16), "tensor", "stochastic", 1,
                                                                            False, global_amax=dy_amax)),
        "amax_dy_tokens": bench(lambda: abs_max(dy[:TOKENS])),
        "expert_swiglu_bwd": bench(lambda: expert_swiglu_backward_triton(h_, probs, da)),
        "expert_swiglu_bwd_amax": bench(lambda: expert_swiglu_backward_triton(h_, probs, da, amax=True)),
    }
    for k_, v in bwd_stages.items():
        log(f"  bwd stage {k_:26s} {v * 1e3:8.1f} us")
    res["expert_block_bwd_stages_us"] = {k_: v * 1e3 for k_, v in bwd_stages.items()}
    del dh

    # NVFP4 emulation in plain torch ops: the reference quantiser + bf16 block values + _grouped_mm + scales
    from minite.nvfp4 import quantize_reference
    w1v = torch.stack([q.block_values(torch.bfloat16) for q in q1])
    w2v = torch.stack([q.block_values(torch.bfloat16) for q in q2])
    g1 = torch.stack([q.global_scale for q in q1])
    g2 = torch.stack([q.global_scale for q in q2])
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS, device="cuda"), counts.long())

    def emu_fwd():
        qx_ = quantize_reference(x, block=(1, 16), scale_scope="row", rounding="nearest", seed=None, rht=False)
        h_ = torch._grouped_mm(qx_.block_values(torch.bfloat16), w1v.transpose(1, 2), offs=offs)
        h_ = (h_.float() * (qx_.global_scale[:, None] * g1[expert_of_row][:, None])).bfloat16()
        a_ = F.silu(h_[:, :FFN]) * h_[:, FFN:]
        qa_ = quantize_reference(a_, block=(1, 16), scale_scope="row", rounding="nearest", seed=None, rht=False)
        y_ = torch._grouped_mm(qa_.block_values(torch.bfloat16), w2v.transpose(1, 2), offs=offs)
        return (y_.float() * (qa_.global_scale[:, None] * g2[expert_of_row][:, None])).bfloat16()

    t_emu = bench(emu_fwd, rep=100)
    log(f"block torch-ops NVFP4 emulation fwd {t_emu:.3f} ms")
    res.update({
        "expert_block_fwd_ratio_vs_bf16": t_w4_fwd / t_bf16_fwd,
        "expert_block_fwdbwd_ratio_vs_bf16": t_w4_fb / t_bf16_fb,
        "expert_block_speedup_vs_torch_emulation": t_emu / t_w4_fwd,
        "expert_block_ms": {"bf16_fwd": t_bf16_fwd, "bf16_fwdbwd": t_bf16_fb, "bf16_fwd_eager_swiglu": t_bf16_fwd_eager,
                            "bf16_fwdbwd_eager_swiglu": t_bf16_fb_eager, "w4a4_fwd": t_w4_fwd,
                            "w4a4_fwdbwd": t_w4_fb, "torch_emulation_fwd": t_emu},
        "expert_block_fwd_stages_us": {k: v * 1e3 for k, v in stages.items()},
        "expert_block_torchao_peer": None,
        "expert_block_torchao_peer_reason": "torchao is not installed on the device image and no wheel was carried",
        "expert_block_gemm_config": vars(cfg) if cfg else "default_config",
    })


# ---------------------------------------------------------------- decode
DECODE_CANDIDATES = [GemmConfig(16, 64, 128, 4, 4), GemmConfig(16, 128, 128, 4, 4), GemmConfig(32, 64, 128, 4, 4),
                     GemmConfig(16, 64, 128, 4, 4, True), GemmConfig(16, 128, 128, 4, 4, True),
                     GemmConfig(16, 64, 256, 4, 4, True), GemmConfig(16, 64, 128, 4, 6, True),
                     GemmConfig(32, 64, 128, 4, 4, True), GemmConfig(16, 128, 128, 8, 4, True)]
def section_decode(res: dict, decode_cfg: GemmConfig | None) -> None:
    sets, e, n, k = 8, 8, 2 * FFN, HIDDEN
    wb = [(torch.randn(e, k, n, device="cuda") * k ** -0.5).bfloat16() for _ in range(sets)]  # bmm layout [E, K, N]
    wq = []
    for s in range(sets):
        qs = [quantize_triton(wb[s][i].t().contiguous(), (16, 16), "tensor", "nearest", None, False) for i in range(e)]
        wq.append(stack_expert_weights(qs, decode=True))  # the rollout's layout (in the decode order)
    res["decode_speedup_vs_bf16"] = {}
    res["decode_us"] = {}
    for m in (1, 4, 16, 32):
        xs = [torch.randn(e, m, k, device="cuda").bfloat16() for _ in range(sets)]
        counts = torch.full((e,), m, dtype=torch.int32, device="cuda")

        def bf16_all():
            for s in range(sets):
                torch.bmm(xs[s], wb[s])

        qpre = [quantize_triton(xs[s].view(e * m, k), (1, 16), "row", "nearest", None, False) for s in range(sets)]

        t_b = bench_graph(bf16_all, sets)
        best_cfg, best_t = decode_cfg, None
        if decode_cfg is None:
            ref = grouped_gemm_triton(qpre[0], wq[0], counts, torch.bfloat16, config=GemmConfig(128, 128, 64, 8, 4))
            for c in DECODE_CANDIDATES:
                if c.block_m < m and m > 16:
                    continue
                try:
                    same = torch.equal(grouped_gemm_triton(qpre[0], wq[0], counts, torch.bfloat16, config=c), ref)
                    tc = bench_graph(lambda: [grouped_gemm_triton(qpre[s], wq[s], counts, torch.bfloat16, config=c)
                                              for s in range(sets)], sets)
                except Exception as exc:
                    log(f"  decode M={m} {vars(c)} failed: {type(exc).__name__}")
                    continue
                log(f"  decode M={m} {vars(c)}: {tc * 1e3:.1f} us bitwise_vs_train_tile={same}")
                if same and (best_t is None or tc < best_t):
                    best_cfg, best_t = c, tc
        cfg_m = best_cfg

        def w4_all():
            for s in range(sets):
                qa = quantize_triton(xs[s].view(e * m, k), (1, 16), "row", "nearest", None, False)
                grouped_gemm_triton(qa, wq[s], counts, torch.bfloat16, config=cfg_m, rows_hint=m)

        def w4_gemm_only():
            for s in range(sets):
                grouped_gemm_triton(qpre[s], wq[s], counts, torch.bfloat16, config=cfg_m, rows_hint=m)

        t_w = bench_graph(w4_all, sets)
        t_g = bench_graph(w4_gemm_only, sets)
        if m == 1:  # same kernel and tiles, weights as fp16 block values (4x the bytes, no nibble decode)
            # (values of bf16 random weights, not of the quantised ones: same bytes and timing, bits unused)
            wv = [ExpertWeights(w.data, w.scale, w.amax, wb[s_].transpose(1, 2).contiguous().half(),
                                w.block_rows, w.shape) for s_, w in enumerate(wq)]
            t_v = bench_graph(lambda: [grouped_gemm_triton(qpre[s], wv[s], counts, torch.bfloat16, config=cfg_m)
                                       for s in range(sets)], sets)
            res["decode_m1_values_weights_us"] = t_v * 1e3
            log(f"decode M=1 with fp16-value weights (no decode, 4x bytes): {t_v * 1e3:.1f} us")
        res.setdefault("decode_config", {})[str(m)] = vars(cfg_m) if cfg_m else "default"
        res["decode_speedup_vs_bf16"][str(m)] = t_b / t_w
        res["decode_us"][str(m)] = {"bf16_bmm": t_b * 1e3, "w4a4_quant_plus_gemm": t_w * 1e3,
                                    "w4a4_gemm_only": t_g * 1e3}
        log(f"decode M={m:2d}: bmm {t_b * 1e3:6.1f} us  w4a4 {t_w * 1e3:6.1f} us (gemm only {t_g * 1e3:6.1f})"
            f"  speedup {t_b / t_w:.2f}x")


# ---------------------------------------------------------------- tile sweep
def sweep_train_config() -> GemmConfig:
    """Pick the fastest training tile for the FC1 grouped GEMM (all candidates compute the same bits)."""
    gen = torch.Generator().manual_seed(1)
    rows = TOKENS * TOPK
    counts = _routing_counts(rows, EXPERTS, gen).cuda()
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    w = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda") * 0.02).bfloat16()
    _, ws, _ = _quant_weights(w, False)
    qx, xv = quantize_with_values_triton(x, (1, 16), "row", "nearest", None, False)
    flops = 2 * rows * HIDDEN * 2 * FFN
    best, best_t, ref = None, 1e9, None
    for c in [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 4, 4),
              GemmConfig(256, 128, 64, 8, 3), GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 256, 64, 8, 4)]:
        try:
            out = grouped_gemm_triton(qx, ws, counts, torch.bfloat16, a_values=xv, config=c)
            t = bench(lambda: grouped_gemm_triton(qx, ws, counts, torch.bfloat16, a_values=xv, config=c), rep=100)
        except Exception as exc:  # e.g. out of shared memory for this tile
            log(f"  tile {vars(c)}: failed {type(exc).__name__}")
            continue
        same = "" if ref is None else ("  bitwise=" + str(torch.equal(out, ref)))
        ref = out if ref is None else ref
        log(f"  tile {vars(c)}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s{same}")
        if t < best_t:
            best, best_t = c, t
    return best


def section_segments(res: dict) -> None:
    """Grouped quantisation of the learner's MoE path, tile sweep (every tile gives the same bits, checked):
    the expert-weight stack (128 x [1536, 2048], 16x16 blocks, values) and the wgrad operand x^T (2048 x 131072
    permuted tokens in 128 column segments, RHT, read through the transposed view)."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda") * 0.02).bfloat16()
    counts = [c + (-c) % 16 for c in _routing_counts(TOKENS * TOPK, EXPERTS, gen).tolist()]
    x = torch.randn(sum(counts), HIDDEN, device="cuda").bfloat16()
    ps = [sum(counts[:i]) for i in range(EXPERTS)]  # each expert's first (padded) token
    cases = {
        "stack": (w.reshape(-1, HIDDEN), [(e * 2 * FFN, 0, 2 * FFN, HIDDEN, e * 2 * FFN, 0) for e in range(EXPERTS)],
                  (EXPERTS * 2 * FFN, HIDDEN), (16, 16), False, [{"elems": n, "warps": wp, "vec2d": v}
                                                                   for v in (True, False) for n in (2048, 4096, 8192)
                                                                   for wp in (4, 8)]),
        "wgrad_xT_rht": (x.t(), [(0, s, HIDDEN, c, 0, s) for s, c in zip(ps, counts)], (HIDDEN, sum(counts)), (1, 16),
                         True,
            [{"elems": n, "warps": wp, "vec2d": True, "rows": r}
             for r in (32, 64) for n in (2048, 4096, 8192) for wp in (4, 8)]),
    }
    # the learner's call since c870e45: raw token counts, the kernel pads each expert to 16 (reads `count` of `width`)
    raw = [max(0, c - int(torch.randint(0, 16, (), generator=gen))) for c in counts]
    xr = torch.randn(sum(raw), HIDDEN, device="cuda").bfloat16()
    rs = [sum(raw[:i]) for i in range(EXPERTS)]
    cases["wgrad_xT_rht_selfpad"] = (xr.t(), [(0, r, HIDDEN, c, 0, q, n) for r, q, c, n in zip(rs, ps, counts, raw)],
                                     (HIDDEN, sum(counts)), (1, 16), True, [])
    flat, amax = w.reshape(-1, HIDDEN), stack_amax(w)
    t = bench(lambda: ns.quantize_segments_triton(flat, cases["stack"][1], tuple(flat.shape), (16, 16), "nearest",
                                                  None, False, torch.float16, amax=amax), rep=50)
    res["segments_us"] = {"stack_amax_given_us": t * 1e3}  # the learner's weights: amax from the optimizer's copy
    log(f"  stack, each expert's amax given (one pass, values): {t * 1e3:.1f} us")
    for name, (src, segs, shape, block, rht, tunings) in cases.items():
        nelem = shape[0] * shape[1]
        base, best = None, None
        def run(tu=None):
            return ns.quantize_segments_triton(src, segs, shape, block, "nearest", None, rht, torch.float16, tuning=tu)

        for tu in [None] + (tunings if SWEEP else []):
            fn = lambda: run(tu)  # noqa: E731
            out = fn()
            t = bench(fn, rep=50)
            bits = [t_.view(torch.uint8) if t_.dtype == torch.float8_e4m3fn else t_ for t_ in out]
            same = "" if base is None else f" bitwise={all(torch.equal(a, b) for a, b in zip(bits, base))}"
            out = bits
            base = out if base is None else base
            log(f"  segments {name} tuning={tu or 'default'}: {t * 1e3:.1f} us, "
                f"{nelem * (src.element_size() + 2.5625) / t / 1e9:.2f} TB/s (two reads + codes/scales/values){same}")
            if tu is None:
                res["segments_us"][name] = {"default_us": t * 1e3}
            elif best is None or t < best[0]:
                best = (t, tu)
        if best is not None:
            res["segments_us"][name].update(best_us=best[0] * 1e3, best_tuning=best[1])
        if SWEEP and name != "stack":  # the amax pass's programs per SM (same bits: an exact max)
            shipped = nq.TUNING["amax"]["segment_programs_per_sm"]
            sweep_pps = {}
            for pps in (8, 16, 32, 64, 128):
                nq.TUNING["amax"]["segment_programs_per_sm"] = pps
                sweep_pps[pps] = bench(run, rep=50) * 1e3
                log(f"  segments {name} amax programs_per_sm={pps}: {sweep_pps[pps]:.1f} us")
            nq.TUNING["amax"]["segment_programs_per_sm"] = shipped
            res["segments_us"][name]["amax_programs_per_sm_us"] = sweep_pps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs/benchmarks/kernels-h200.json")
    p.add_argument("--sections", default="copy,quant,sweep,block,decode")
    p.add_argument("--decode-config", default="", help="bm,bn,bk,warps,stages")
    p.add_argument("--no-sweep", action="store_true",
                   help="skip the quantisation tile sweeps: every number is the shipped tiles' (headline runs)")
    p.add_argument("--learner-slice", default="", metavar="JSON",
                   help="the output of tools/bench/bench_learner_slice.py from the same device run, merged in")
    args = p.parse_args()
    global SWEEP
    SWEEP = not args.no_sweep
    sections = args.sections.split(",")
    res: dict = {"errors": {}}

    def guarded(name, fn, *a):
        try:
            return fn(*a)
        except Exception:  # keep the other sections' numbers; the JSON records what failed
            import traceback
            res["errors"][name] = traceback.format_exc()
            log(f"section {name} FAILED:\n{res['errors'][name]}")
            return None

    if "copy" in sections or "quant" in sections:
        guarded("copy_quant", section_copy_quant, res)
    if "segments" in sections:
        guarded("segments", section_segments, res)
    cfg = guarded("sweep", sweep_train_config) if "sweep" in sections else None
    if cfg:
        log(f"training tile: {vars(cfg)}")
    if "block" in sections:
        guarded("block", section_block, res, cfg)
    if "rollout_gemm" in sections:
        guarded("rollout_gemm", section_rollout_gemm, res)
    if "rollout_dense" in sections:
        guarded("rollout_dense", section_rollout_dense, res)
    if "decode" in sections:
        dcfg = GemmConfig(*map(int, args.decode_config.split(","))) if args.decode_config else None
        guarded("decode", section_decode, res, dcfg)
    res["learner_slice_nvfp4_over_bf16_tokens_per_s"] = None
    res["learner_slice_reason"] = "not run in this call (--learner-slice)"
    if args.learner_slice:
        with open(args.learner_slice) as f:
            sl = json.load(f)
        res["learner_slice"] = sl
        res["learner_slice_nvfp4_over_bf16_tokens_per_s"] = sl.get("nvfp4_over_bf16_tokens_per_s")
        res["learner_slice_reason"] = (f"tools/bench/bench_learner_slice.py --layers {sl.get('layers')} --seq "
                                       f"{sl.get('seq')}, same device call")
    res.update({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                **stamp(), "log": LOG})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
