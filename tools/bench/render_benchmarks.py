"""Render docs/benchmarks.md's kernel table from docs/benchmarks/kernels-h200.json (numbers are never typed by hand).

    python tools/bench/render_benchmarks.py docs/benchmarks/kernels-h200.json > docs/benchmarks/kernels-h200.md
"""
from __future__ import annotations

import json
import sys

TARGETS = {
    "quant_fraction_of_copy": (">=", 0.80),
    "expert_block_fwd_ratio_vs_bf16": ("<=", 1.10),
    "expert_block_fwdbwd_ratio_vs_bf16": ("<=", 1.15),
    "expert_block_speedup_vs_torch_emulation": (">=", 5.0),
}


def _met(value, op, target) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if op == ">=" else value <= target) else "missed"


def render(d: dict) -> str:
    out = [f"Device {d['device']} (torch {d['torch']}, triton {d['triton']}), {d['date']}, commit {d['commit']}, "
           f"command `{d['command']}`. One run, medians of "
           "triton.testing.do_bench (decode: CUDA-graph replays over 8 rotating weight sets).", "",
           "| metric | measured | target | |", "|---|---|---|---|",
           f"| device copy, 131072x2048 bf16 (read + write) | {d['copy_TBps']:.3f} TB/s | ceiling | |"]
    for key, (op, target) in TARGETS.items():
        v = d.get(key)
        out.append(f"| {key} | {'-' if v is None else f'{v:.3f}'} | {op} {target} | {_met(v, op, target)} |")
    for m, v in d.get("decode_speedup_vs_bf16", {}).items():
        out.append(f"| decode_speedup_vs_bf16, M={m} | {v:.2f}x | >= 3.5x | {_met(v, '>=', 3.5)} |")
    ratio = d.get("learner_slice_nvfp4_over_bf16_tokens_per_s")
    out.append(f"| learner_slice_nvfp4_over_bf16_tokens_per_s | {'-' if ratio is None else f'{ratio:.3f}'} | >= 0.95 "
               f"| {_met(ratio, '>=', 0.95)}: {d.get('learner_slice_reason', '')} |")
    for row in d.get("learner_slice", {}).get("rows", []):
        if "error" in row:
            out.append(f"| learner slice {row['precision']} | failed: {row['error']} | | |")
            continue
        name = f"learner slice {row['precision']}, {row.get('micro_batches', 1)} x {row.get('tokens', 0) // max(row.get('micro_batches', 1), 1)} tokens"
        if row.get("expert_wgrad_passes") and row.get("micro_batches", 1) > 1:
            name += f", expert wgrads {row['expert_wgrad_passes']} micro-batch(es) a launch"
        out.append(f"| {name}: tokens/s (step s, peak GiB) | {row['tokens_per_s']:,.0f} "
                   f"({row['step_s']:.3f} s, {row['peak_mem_gib']:.1f} GiB) | | |")
        out.append(f"| {name}: model TFLOP/s | {row['model_tflops']:.1f} | >= 200 "
                   f"| {_met(row['model_tflops'], '>=', 200)} |")
    out += ["", "Expert block (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in d.get("expert_block_ms", {}).items()),
            "", "Forward stages (us): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                    d.get("expert_block_fwd_stages_us", {}).items()),
            "", "Backward stages (us): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                     d.get("expert_block_bwd_stages_us", {}).items()),
            "", "Quantisation variants (us, fraction of copy): " + ", ".join(
                f"{k} {v['us']:.0f} ({v['fraction_of_copy']:.2f})" for k, v in d.get("quant_variants", {}).items()),
            "", "Decode (us): " + "; ".join(
                f"M={m}: bmm {v['bf16_bmm']:.1f}, W4A4 quant+GEMM {v['w4a4_quant_plus_gemm']:.1f}, GEMM only "
                f"{v['w4a4_gemm_only']:.1f}" for m, v in d.get("decode_us", {}).items())]
    if "decode_measured_in" in d:
        src = d["decode_measured_in"]
        out.append(f"Decode rows and numbers: {src['file']}, {src['date']}, commit {src['commit']}, command "
                   f"`{src['command']}` ({src['note']}).")
    rg = d.get("rollout_gemm_us")
    if rg:
        src = d.get("rollout_gemm_measured_in", {})
        out += ["", f"Expert GEMMs of one decode step of the rollout slice (us; {src.get('date', '')}, commit "
                f"{src.get('commit', '')}; best packed = fastest packed-weight variant, every one bitwise equal to the "
                "training tile):", "", "| GEMM | batch | BF16 grouped_mm | W4A4, fp16 block-value weights | "
                "W4A4, packed weights (best) | best variant |", "|---|---|---|---|---|---|"]
        for fc, rows in rg.items():
            for b, r in rows.items():
                best = r.get("best_packed")
                out.append(f"| {fc} | {b} | {r['bf16_grouped_mm']:.1f} | {r['w4a4_values_default']:.1f} | "
                           f"{r[best]:.1f} | {best[len('packed_'):]} |" if best else
                           f"| {fc} | {b} | {r['bf16_grouped_mm']:.1f} | {r['w4a4_values_default']:.1f} | - | - |")
    if "decode_m1_values_weights_us" in d:
        out.append(f"(same decode kernel, M=1, fp16 block-value weights instead of packed nibbles: "
                   f"{d['decode_m1_values_weights_us']:.1f} us)")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(json.load(open(sys.argv[1]))), end="")
