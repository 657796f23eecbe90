"""Where issues 16 (rollout) and 17 (learner) stand: each goal against the newest measurement of each device, rendered
from the JSON in docs/benchmarks/ (numbers are never typed by hand; docs/benchmarks.md's first table is this output).

    python tools/bench/goals.py [--dir docs/benchmarks] [--devices h200,h100]

Per device (DEV in the file names):
- rollout: the rows of bench_rollout.py in rollout-DEV.json and rollout-long-context-DEV.json, of the embedded engine
  (not SGLang) at the issue's 32-token prompts; of each precision, mode and batch the row of the newest code (the
  commit it names, ordered by git history; rows of one commit by their date). A/B calls measured older code after
  newer, so the time a row was measured does not say which code is newest. Reference rows: the newest.
- kernels-DEV.json (bench_nvfp4.py), learner-slice-DEV.json (bench_learner_slice.py), alignment-DEV.jsonl
  (tools/alignment_gpu.py: the newest strict-mode gap of each model and precision). Files named after a commit
  (kernels-h100-c81a948.json) and A/B files are older snapshots and are not read.
A ratio of two rows names both commits when they differ: issue 16 asks for its goals measured side by side, in one
run, and such a cell is not that. A device without a file says so; a cell never falls back to another device.
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import latest  # noqa: E402  (a script's module, found through its folder)

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path):
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def _verdict(value: float, op: str, target: float) -> str:
    return "met" if (value >= target if op == ">=" else value <= target) else "missed"


def _when(*rows: dict, doc: dict | None = None) -> str:
    """The commits (and the newest date) of the rows a cell was computed from: "c81a948, 2026-12-06"."""
    commits = list(dict.fromkeys(str(r.get("commit", (doc or {}).get("commit", "?"))) for r in rows))
    dates = sorted(str(r.get("date", (doc or {}).get("date", "?")))[:10] for r in rows)
    two = " (rows of different commits)" if len(commits) > 1 else ""
    return f"{' / '.join(commits)}, {dates[-1]}{two}"


def _cell(value: float, op: str, target: float, text: str, when: str) -> str:
    """A measured cell: what was measured, the verdict against the target, and the rows' commits and date."""
    return f"{text}: **{_verdict(value, op, target)}** ({when})"


@functools.lru_cache(maxsize=None)
def _commit_time(commit: str) -> int:
    """The committer time of a row's commit ("29c3e4e" or "29c3e4e+MINITE_TRY_KERNELS=..."), 0 if git cannot say."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%ct", commit.split("+")[0]],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip()) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def rollout_rows(folder: Path, dev: str) -> dict | None:
    """One device's rollout rows (module docstring), each with its own commit and date, newest code last."""
    docs = [d for d in (_load(folder / f"rollout-{dev}.json"), _load(folder / f"rollout-long-context-{dev}.json"))
            if d is not None]
    if not docs:
        return None
    def stamped(r: dict, d: dict) -> dict:  # a row with its own commit and date, or its file's
        return dict(r, commit=r.get("commit", d.get("commit", "?")), date=r.get("date", d.get("date", "?")))

    rows = [stamped(r, d) for d in docs for r in d["rows"] if r.get("variant") != "sglang" and r["prompt_len"] == 32]
    refs = [stamped(r, d) for d in docs for r in d.get("reference_rows", [])]
    rows.sort(key=lambda r: (_commit_time(r["commit"]), r["date"]))
    refs.sort(key=lambda r: r["date"])
    return {"rows": rows, "reference_rows": refs}


def rollout_goals(doc: dict | None) -> dict:
    """Issue 16's step goals at batch 64 from one device's rollout rows (`rollout_rows`)."""
    names = ("bf16_vs_reference", "nvfp4_tokens_vs_bf16", "nvfp4_step_vs_floor", "strict_vs_default")
    if doc is None:
        return dict.fromkeys(names, "no rollout JSON")
    head = latest(doc)
    row = {(r["precision"], r["strict"], r["batch"]): r for r in head["rows"]}
    ref = {r["batch"]: r for r in head["reference_rows"] if r.get("graph")}
    out = {}
    bf16, nvfp4, strict = (row.get(k) for k in (("bf16", False, 64), ("nvfp4", False, 64), ("nvfp4", True, 64)))
    if bf16 and 64 in ref:
        v = bf16["step_ms"] / ref[64]["step_ms"]
        out[names[0]] = _cell(v, "<=", 1.25, f"{v:.3f} ({bf16['step_ms']:.2f} / {ref[64]['step_ms']:.2f} ms)",
                              _when(bf16, ref[64], doc=doc))
    if bf16 and nvfp4:
        v = nvfp4["decode_tokens_per_s"] / bf16["decode_tokens_per_s"]
        out[names[1]] = _cell(v, ">=", 2.0, f"{v:.3f}x ({nvfp4['step_ms']:.2f} / {bf16['step_ms']:.2f} ms a step)",
                              _when(nvfp4, bf16, doc=doc))
    if nvfp4:
        v = nvfp4["step_ms"] / nvfp4["floor_ms"]
        out[names[2]] = _cell(v, "<=", 3.0, f"{v:.2f}x ({nvfp4['step_ms']:.2f} / {nvfp4['floor_ms']:.2f} ms)",
                              _when(nvfp4, doc=doc))
    if nvfp4 and strict:
        v = strict["step_ms"] / nvfp4["step_ms"]
        out[names[3]] = _cell(v, "<=", 1.25, f"{v:.3f} ({strict['step_ms']:.2f} / {nvfp4['step_ms']:.2f} ms)",
                              _when(strict, nvfp4, doc=doc))
    return {n: out.get(n, "no batch-64 rows") for n in names}


def strict_gap(lines: list | None) -> str:
    """The newest strict-mode log-prob gaps of `minite diagnose`'s GPU run (alignment-DEV.jsonl: a device line, then
    one line per comparison): their largest |gap| over both precisions."""
    if lines is None:
        return "no alignment JSONL"
    device, newest = {}, {}
    for d in lines:
        if d.get("kind") == "device":
            device = d
        elif d.get("kind") == "gap" and d.get("strict"):
            newest[(d.get("model"), d["precision"])] = dict(d, commit=device.get("commit"), date=device.get("date"))
    if not newest:
        return "no strict gap recorded"
    rows = list(newest.values())
    v = max(r["max_abs_logp_gap"] for r in rows)
    precisions = "/".join(sorted({r["precision"] for r in rows}))
    return _cell(v, "<=", 0.0, f"{v:g} ({precisions}, {sum(r['tokens_compared'] for r in rows)} tokens)",
                 _when(*rows))


def kernel_goals(doc: dict | None) -> dict:
    names = ("decode_gemm", "block_fwd", "block_fwdbwd", "quant")
    if doc is None:
        return dict.fromkeys(names, "no kernels JSON")
    when = _when(doc)
    out = {}
    dec = doc.get("decode_speedup_vs_bf16") or {}
    if dec:
        worst = min(dec, key=dec.get)
        out["decode_gemm"] = _cell(dec[worst], ">=", 3.5, f"{min(dec.values()):.2f}-{max(dec.values()):.2f}x "
                                   f"(M = {', '.join(dec)}; lowest at M = {worst})", when)
    for name, key, target in (("block_fwd", "expert_block_fwd_ratio_vs_bf16", 1.10),
                              ("block_fwdbwd", "expert_block_fwdbwd_ratio_vs_bf16", 1.15)):
        if doc.get(key) is not None:
            out[name] = _cell(doc[key], "<=", target, f"{doc[key]:.3f}x", when)
    variants = {k: v["fraction_of_copy"] for k, v in (doc.get("quant_variants") or {}).items()}
    if variants:
        worst = min(variants, key=variants.get)
        out["quant"] = _cell(variants[worst], ">=", 0.8, f"{variants[worst]:.3f} ({worst}; {len(variants)} variants, "
                             f"{sum(v >= 0.8 for v in variants.values())} at 0.8 or more)", when)
    return {n: out.get(n, "not measured") for n in names}


def learner_goals(doc: dict | None) -> dict:
    names = ("step", "fwd_bwd", "bf16_tflops", "memory")
    if doc is None:
        return dict.fromkeys(names, "no learner-slice JSON")
    rows = {(r["precision"], r.get("micro_batches", 1)): r for r in doc["rows"] if "error" not in r}
    mbs = sorted({mb for p, mb in rows if ("bf16", mb) in rows and ("nvfp4", mb) in rows})
    if not mbs:
        return dict.fromkeys(names, "no BF16/NVFP4 pair")
    pairs = [(mb, rows[("bf16", mb)], rows[("nvfp4", mb)]) for mb in mbs]
    when = _when(*(r for _, b, n in pairs for r in (b, n)), doc=doc)

    def per_mb(values: list, fmt: str) -> str:
        return ", ".join(f"{fmt.format(v)} at {mb} x {b['tokens'] // mb}" for v, (mb, b, _) in zip(values, pairs))

    step = [n["tokens_per_s"] / b["tokens_per_s"] for _, b, n in pairs]
    fb = [b["fwd_bwd_s"] / n["fwd_bwd_s"] for _, b, n in pairs]
    tf = [b["fwd_bwd_model_tflops"] for _, b, _ in pairs]
    mem = [n["peak_mem_gib"] - b["peak_mem_gib"] for _, b, n in pairs]
    return {"step": _cell(min(step), ">=", 0.95, per_mb(step, "{:.3f}"), when),
            "fwd_bwd": _cell(min(fb), ">=", 0.9, per_mb(fb, "{:.3f}"), when),
            "bf16_tflops": _cell(min(tf), ">=", 200, per_mb(tf, "{:.0f}"), when),
            "memory": _cell(max(mem), "<=", 0.0, per_mb(mem, "{:+.2f} GiB"), when)}


GOALS = [  # issue, goal, target, (source, key)
    (16, "BF16 decode step / plain-PyTorch CUDA-graph step, batch 64", "<= 1.25", ("rollout", "bf16_vs_reference")),
    (16, "NVFP4 / BF16 decode tokens/s, batch 64", ">= 2x", ("rollout", "nvfp4_tokens_vs_bf16")),
    (16, "NVFP4 decode step / its HBM floor, batch 64", "<= 3x", ("rollout", "nvfp4_step_vs_floor")),
    (16, "strict / default NVFP4 decode step, batch 64", "<= 1.25", ("rollout", "strict_vs_default")),
    (16, "strict learner/rollout log-prob gap (`minite diagnose`)", "0", ("alignment", None)),
    (16, "W4A4 decode GEMM / BF16 bmm (decode_speedup_vs_bf16)", ">= 3.5x", ("kernels", "decode_gemm")),
    (17, "expert block forward / BF16", "<= 1.10x", ("kernels", "block_fwd")),
    (17, "expert block forward+backward / BF16", "<= 1.15x", ("kernels", "block_fwdbwd")),
    (17, "every quantisation variant, fraction of copy bandwidth (the lowest)", ">= 0.8", ("kernels", "quant")),
    (17, "learner slice NVFP4 / BF16 tokens/s, whole step", ">= 0.95", ("learner", "step")),
    (17, "learner slice NVFP4 / BF16, forward+backward", ">= 0.9", ("learner", "fwd_bwd")),
    (17, "learner slice BF16 forward+backward, model TFLOP/s", ">= 200", ("learner", "bf16_tflops")),
    (17, "learner slice NVFP4 peak memory - BF16 peak", "<= 0", ("learner", "memory")),
]


def device_cells(folder: Path, dev: str) -> dict:
    found = {"rollout": rollout_goals(rollout_rows(folder, dev)),
             "kernels": kernel_goals(_load(folder / f"kernels-{dev}.json")),
             "learner": learner_goals(_load(folder / f"learner-slice-{dev}.json"))}
    gap = strict_gap(_load(folder / f"alignment-{dev}.jsonl"))
    return {(src, key): gap if src == "alignment" else found[src][key] for _, _, _, (src, key) in GOALS}


def render(folder: Path, devices: list) -> str:
    cells = {dev: device_cells(folder, dev) for dev in devices}
    out = ["| issue | goal | target | " + " | ".join(d.upper() for d in devices) + " |",
           "|---|---|---|" + "---|" * len(devices)]
    for issue, goal, target, source in GOALS:
        out.append(f"| {issue} | {goal} | {target} | " + " | ".join(cells[d][source] for d in devices) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(ROOT / "docs" / "benchmarks"), help="the folder of the JSON files")
    p.add_argument("--devices", default="h200,h100", help="file-name suffixes, one column each")
    a = p.parse_args(argv)
    print(render(Path(a.dir), a.devices.split(",")), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
