"""Rollout decode speed of the embedded engine (issue 16): BF16 / NVFP4, default / strict, several batch sizes, each
row beside its HBM floor, and a plain-PyTorch BF16 decode step as the yardstick.

    python tools/bench/bench_rollout.py --out docs/benchmarks/rollout-h200.json          (one H200: the full slice)
    python tools/bench/bench_rollout.py --tiny --batches 1,4 --out /tmp/rollout.json     (CPU smoke run)
    python tools/bench/bench_rollout.py --render docs/benchmarks/rollout-h200.json       (Markdown for docs/benchmarks.md)
    python tools/bench/bench_rollout.py --render docs/benchmarks/rollout-h200.json --latest   (its headline: the newest
                                                                                   row of each precision/mode/batch)

Model: a `--layers`-layer slice of Qwen3-30B-A3B at full width (hidden 2048, 32 heads / 4 KV groups of head_dim 128,
128 experts top-8 of ffn 768, vocab 151936), random weights, built the way a run builds it:
`minite.rollout.embedded.build_embedded(load_config(None, overrides))`. A strict row switches the same engine's model
with `apply_strict` (what `build_model(cfg, strict=True)` does at build time), so default and strict rows of one
precision share their weights and one model build.

Decode isolated: `batch` prompts of `--prompt-len` random tokens, `generate` with `--new-tokens` (N_long) and with
`--short-tokens` (N_short) new tokens (temperature 1, no stop token); both pay the same prefill, so
    step_ms = (t(N_long) - t(N_short)) / (N_long - N_short),  decode_tokens_per_s = batch / step.
Untimed pairs of generates of N_long and N_short tokens first, until a pair captures no CUDA graph (at most three
pairs; Triton compiles per shape; miniTE's loop runs a shape's first decode step eagerly, captures the others in that
generate and the first in the next; a row's `graph_captures_timed` counts captures in its timed runs, 0 unless a
graph was evicted); --repeats pairs, median. miniTE's loop on a GPU also times its decode steps itself
(`time_decode`: a CUDA event after the prefill's sample, one after the last step): there step_ms is that time of the
N_long run over its N_long - 1 steps (`step_method` "events"; the difference stays in `step_ms_difference`), because
the prefill's run-to-run noise (tens of ms for strict prefill at batch 1) exceeded the whole decode time of
graph-replayed steps.
Loops (--variants): `ships` (the default: what ships for each precision, `graphs` for BF16 and `packed` for NVFP4;
until 2026-12-05 the default was `graphs` for both, which for NVFP4 is the fp16 block-value path that no longer
ships), `graphs` (BF16: what ships), `packed` (graphs with the experts' packed NVFP4 weights: what
ships for NVFP4 since 2026-12-01), `sglang` (SGLang's engine with the minite_nvfp4 plugin, rollout.backend=sglang,
its arguments from `--set rollout.sglang_args=...`; the row adds its start-up and one weight update's seconds),
`eager` (miniTE's loop without graphs), `megatron` (Megatron's controller,
the loop before minite/rollout/decode.py); each row names its `variant`, whether graphs were replayed
(`cuda_graphs_replayed`) and why a capture failed (`graph_error`).

floor_ms = bytes one decode step must read from HBM / HBM_BYTES_PER_S (`floor_bytes`):
- experts: per layer the expected number of distinct experts a batch touches, E * (1 - (1 - k/E)^B) for top-k of E
  with uniformly random routing (B = 64, top-8 of 128: 125.9), each 3 * hidden * ffn weights;
- attention weights (QKV and output projection), RMSNorm weights, the router (always BF16);
- the KV cache: 2 * kv_groups * head_dim BF16 values per layer, position and sequence, at the mean context length of
  the timed steps (prompt_len + (N_short + N_long) / 2);
- the lm_head (always BF16) and the batch's embedding rows.
Weights cost 2 B per element in BF16 and 0.5 + 1/256 B in NVFP4 (E2M1 nibbles and one E4M3 scale per 16x16 block,
the weight role of minite.nvfp4.recipe; docs/scaling.md uses the same 4.03 bits). HBM_BYTES_PER_S = 4.8e12: the
H200's HBM3e bandwidth in NVIDIA's H200 datasheet (4.8 TB/s); the measured device-to-device copy is 4.27 TB/s
(docs/upstream.md), so even a perfect step takes ~1.1x its floor. On an H100 the floor takes its datasheet's 3.35
TB/s (`hbm_bytes_per_s`; since 2026-12-06: earlier H100 rows divided by the H200's rate).

Reference rows (`reference_rows`, same batches): `decode_reference.ReferenceDecoder`, the same layers written in plain
PyTorch with BF16 random weights over a KV cache of the same mean context, timed eagerly and as CUDA-graph replays
(`step_ms` is the graph's; CPU: eager only, `graph` false).

The JSON (written after every row, so a run cut short keeps what it measured): device, date, commit (MINITE_COMMIT
first), command, hbm_bytes_per_s, rows (precision, strict, batch, prompt_len, new_tokens, decode_tokens_per_s,
step_ms, floor_ms, and short_tokens, floor_bytes, experts_touched, t_long_s, t_short_s; the first batch of each
precision and mode also host_syncs_per_step, counted by torch's CUDA sync debug mode, null off the GPU),
reference_rows, errors (a row that failed: its key and the exception, so one out-of-memory row does not hide the
others).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from decode_reference import ReferenceDecoder, Shape, time_step
from profiling import SYNC_WARNING, print_top
from provenance import commit
from shapes import FULL

TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16, num_experts=8,
            moe_router_topk=2, moe_ffn_hidden_size=32)
HBM_BYTES_PER_S = 4.8e12
"""H200 HBM3e bandwidth, NVIDIA H200 datasheet (module docstring): the floor's rate on an H200 and off the GPU."""
HBM_BYTES_PER_S_BY_CARD = {"H200": HBM_BYTES_PER_S, "H100 80GB HBM3": 3.35e12}
"""The datasheet HBM bandwidth of each card a device call may land on, by the name torch gives it (the H100 SXM5 80 GB,
HBM3: 3.35 TB/s; an H100 PCIe or NVL has another rate and keeps the default)."""


def hbm_bytes_per_s() -> float:
    """The floor's rate on this machine: its card's datasheet bandwidth (HBM_BYTES_PER_S_BY_CARD), the H200's
    elsewhere (rows before 2026-12-06 used the H200's on every card, an H100's too: their `hbm_bytes_per_s` says)."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((rate for card, rate in HBM_BYTES_PER_S_BY_CARD.items() if card in name), HBM_BYTES_PER_S)


BYTES_PER_WEIGHT = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 256}
ROW_KEYS = ("precision", "strict", "batch", "prompt_len", "new_tokens", "decode_tokens_per_s", "step_ms", "floor_ms")


VARIANTS = {"graphs": {"loop": "minite", "cuda_graphs": True, "packed_weights": False},
            "eager": {"loop": "minite", "cuda_graphs": False, "packed_weights": False},
            "packed": {"loop": "minite", "cuda_graphs": True, "packed_weights": True},
            "megatron": {"loop": "megatron", "cuda_graphs": False},
            "sglang": {}}  # rollout.backend=sglang: SGLang's engine with the plugin on the same weights (below)
SHIPS = {"bf16": "graphs", "nvfp4": "packed"}  # --variants ships: the loop each precision ships with


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/benchmarks/rollout-h200.json")
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a results file and exit")
    p.add_argument("--latest", action="store_true",
                   help="with --render: only the newest row of each precision, mode and batch (and reference batch)")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--modes", default="default,strict", help="default and/or strict")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=40, help="N_long")
    p.add_argument("--short-tokens", type=int, default=8, help="N_short")
    p.add_argument("--variants", default="ships",
                   help="the engine's loop, comma-separated: ships (what ships: graphs for BF16, packed for NVFP4), "
                        "graphs (miniTE's loop, CUDA-graph decode steps, fp16 "
                        "block-value weights: what shipped until 2026-12-01), eager (miniTE's loop without graphs), "
                        "megatron (Megatron-Core's controller), packed (graphs with rollout.packed_weights: the expert "
                        "GEMMs read packed weight codes; what ships since 2026-12-01, NVFP4 only), sglang (SGLang's "
                        "engine with the minite_nvfp4 plugin on the same weights; its arguments from --set "
                        "rollout.sglang_args=...; each row also times one weight update)")
    p.add_argument("--sampler", default="gumbel", choices=("gumbel", "megatron"),
                   help="miniTE's loop: rollout.sampler (gumbel ships since the thirty-fourth session; every row "
                        "before it used megatron's ops); each such row records it")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--reference-iters", type=int, default=20)
    p.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference rows")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="profile one more generate of N_short tokens at the first batch of each engine, print TOP ops")
    p.add_argument("--no-strict-fused", dest="strict_fused", action="store_false",
                   help="strict rows on strict mode's torch ops alone (minite.strict.fused.ENABLED off: exp, RMSNorm "
                        "and tree sums as tens of elementwise launches each); each strict row records strict_fused")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="more config overrides for the engine (e.g. rollout switches)")
    a = p.parse_args(argv)
    if a.new_tokens <= a.short_tokens or a.short_tokens < 1:
        p.error("--new-tokens must be larger than --short-tokens >= 1")
    if set(a.variants.split(",")) - set(VARIANTS) - {"ships"}:
        p.error(f"--variants takes ships, {', '.join(VARIANTS)}")
    if set(a.modes.split(",")) - {"default", "strict"}:
        p.error("--modes takes default and/or strict")
    if set(a.precisions.split(",")) - set(SHIPS):
        p.error(f"--precisions takes {', '.join(SHIPS)}")
    if not a.strict_fused and "sglang" in a.variants.split(",") and "strict" in a.modes.split(","):
        p.error("--no-strict-fused does not reach SGLang's scheduler process (it imports minite.strict.fused afresh, "
                "on): measure strict sglang rows without it")
    return a


def loops(variants: str, precision: str) -> list:
    """--variants for one precision: `ships` resolved to that precision's loop (SHIPS), `packed` to `graphs` for BF16
    (whose engine has no NVFP4 weights to pack: the same loop, which its rows named `packed` before 2026-12-05),
    repeats dropped, in order."""
    resolved = (SHIPS[precision] if v == "ships" else "graphs" if (v, precision) == ("packed", "bf16") else v
                for v in variants.split(","))
    return list(dict.fromkeys(resolved))


def experts_touched(experts: int, topk: int, batch: int) -> float:
    """Expected distinct experts of one layer that `batch` tokens route to (top-k of E, uniformly random)."""
    return experts * (1.0 - (1.0 - topk / experts) ** batch)


def floor_bytes(shape: dict, layers: int, precision: str, batch: int, context: float) -> float:
    """Bytes one decode step reads from HBM at least (module docstring)."""
    w = BYTES_PER_WEIGHT[precision]
    h, hd, nh, kv = shape["hidden_size"], shape["head_dim"], shape["num_attention_heads"], shape["num_query_groups"]
    e, k, f = shape["num_experts"], shape["moe_router_topk"], shape["moe_ffn_hidden_size"]
    attention = (h * (nh + 2 * kv) * hd + nh * hd * h) * w
    norms = (2 * h + 2 * hd) * 2
    router = h * e * 2
    experts = experts_touched(e, k, batch) * 3 * h * f * w
    kv_cache = 2 * kv * hd * context * batch * 2
    per_layer = attention + norms + router + experts + kv_cache
    return layers * per_layer + shape["vocab_size"] * h * 2 + h * 2 + batch * h * 2


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode_step_s(engine) -> float | None:
    """Seconds per decode step of the engine's last generate, from CUDA events around its decode steps (miniTE's
    loop on a GPU), else None."""
    last = getattr(getattr(engine, "decoder", None), "last_decode", None) if getattr(engine, "loop", "") == "minite" \
        else None
    return None if last is None else last[0] / last[1]


def _timed_generate(engine, prompts, n: int) -> float:
    from minite.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n, seed=0)
    _sync()
    t = time.perf_counter()
    engine.generate(prompts, params)
    _sync()
    return time.perf_counter() - t


def measure_engine(engine, a: argparse.Namespace, shape: dict, precision: str, strict: bool, batch: int) -> dict:
    """One row: the engine's decode step at `batch` (module docstring)."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, shape["vocab_size"], (batch, a.prompt_len), generator=g).tolist()
    # untimed: a first run at a shape may compile, allocate or capture CUDA graphs, which must not land in a timed
    # run (at 84dd093 only the long run was warmed: the first short run captured, inflating t(N_short)). miniTE's
    # loop runs a shape's first decode step eagerly and captures it in the next generate: warm until a pair of runs
    # captures nothing (until 2026-12-06 one pair, so every timed long run captured one step: +0.2 ms a step)
    decoder = getattr(engine, "decoder", None)  # miniTE's loop (the SGLang engine has none: the difference method)

    def captures() -> int:
        return getattr(decoder, "captures", 0)
    for _ in range(3):
        before = captures()
        _timed_generate(engine, prompts, a.new_tokens)
        _timed_generate(engine, prompts, a.short_tokens)
        if captures() == before:
            break
    warm = captures()
    if decoder is not None:
        decoder.time_decode = True
    pairs, events = [], []
    for _ in range(a.repeats):
        t_long = _timed_generate(engine, prompts, a.new_tokens)
        events.append(_decode_step_s(engine))  # of the long run
        pairs.append((t_long, _timed_generate(engine, prompts, a.short_tokens)))
    if decoder is not None:
        decoder.time_decode = False
    difference = statistics.median(tl - ts for tl, ts in pairs) / (a.new_tokens - a.short_tokens)
    # miniTE's loop on a GPU: the decode steps' own time (CUDA events after the prefill and after the last step) of
    # the long runs; else the difference of the long and short runs (noisy where the prefill varies more than the
    # decode steps add up to: strict prefill at batch 1)
    timed = all(e is not None for e in events)
    step = statistics.median(events) if timed else difference
    context = a.prompt_len + (a.short_tokens + a.new_tokens) / 2
    fb = floor_bytes(shape, a.layers, precision, batch, context)
    return {"precision": precision, "strict": strict, "batch": batch, "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens, "decode_tokens_per_s": batch / step, "step_ms": step * 1e3,
            "floor_ms": fb / hbm_bytes_per_s() * 1e3, "short_tokens": a.short_tokens, "floor_bytes": fb,
            "experts_touched": experts_touched(shape["num_experts"], shape["moe_router_topk"], batch),
            "t_long_s": statistics.median(p[0] for p in pairs), "t_short_s": statistics.median(p[1] for p in pairs),
            "step_method": "events" if timed else "difference", "step_ms_difference": difference * 1e3,
            "graph_captures_timed": captures() - warm}


def host_syncs_per_step(engine, a: argparse.Namespace, shape: dict, batch: int) -> float | None:
    """Host synchronisations per decode step on a GPU: torch's CUDA sync debug mode warns at every synchronising
    operation (a value read, a copy to pageable host memory, a data-dependent output size); counted over generate
    calls of 4 and 8 new tokens (each after an untimed call of its shape). None off the GPU (nothing synchronises there)."""
    if not torch.cuda.is_available():
        return None
    prompts = torch.randint(1, shape["vocab_size"], (batch, a.prompt_len), generator=torch.Generator().manual_seed(1))
    for n in (4, 8):  # untimed: a first call at a shape captures its graphs (capture synchronises)
        _timed_generate(engine, prompts.tolist(), n)
    counts = []
    for n in (4, 8):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _timed_generate(engine, prompts.tolist(), n)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum(SYNC_WARNING in str(w.message) for w in caught))
    return (counts[1] - counts[0]) / 4


def measure_reference(a: argparse.Namespace, shape: dict, batch: int) -> dict:
    cuda = torch.cuda.is_available()
    context = a.prompt_len + (a.short_tokens + a.new_tokens) // 2
    dec = ReferenceDecoder(Shape(num_layers=a.layers, **shape), batch, context, "cuda" if cuda else "cpu")
    warm = 3
    eager = time_step(dec, a.reference_iters, warm, graph=False)
    graph, graph_error = None, None
    if cuda:
        try:
            graph = time_step(dec, a.reference_iters, warm, graph=True)
        except Exception as e:  # noqa: BLE001  (the eager number still stands; the reason goes in the row)
            graph_error = f"{type(e).__name__}: {e}"[:300]
    step = graph if graph is not None else eager
    fb = floor_bytes(shape, a.layers, "bf16", batch, context)
    row = {"precision": "bf16", "batch": batch, "context": context, "step_ms": step * 1e3,
           "eager_step_ms": eager * 1e3, "graph": graph is not None, "decode_tokens_per_s": batch / step,
           "floor_ms": fb / hbm_bytes_per_s() * 1e3, "grouped_mm": dec.grouped}
    return row if graph_error is None else dict(row, graph_error=graph_error)


def engine_config(a: argparse.Namespace, shape: dict, precision: str, more: list | None = None):
    from minite.config import load_config

    sets = [f"model.{k}={v}" for k, v in shape.items()]
    sets += [f"model.num_layers={a.layers}", f"precision.mode={precision}",
             f"model.max_position_embeddings={a.prompt_len + a.new_tokens + 8}"]
    return load_config(None, sets + (more or []) + a.overrides)


def write(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engines(a: argparse.Namespace, shape: dict, doc: dict, out: Path) -> None:
    from minite.megatron_patches.strict import apply_strict
    from minite.rollout.embedded import EmbeddedEngine, build_embedded

    batches = [int(b) for b in a.batches.split(",")]
    for precision in a.precisions.split(","):
        model = build_embedded(engine_config(a, shape, precision)).model
        for mode, variant in [(m, v) for m in ("default", "strict") for v in loops(a.variants, precision)]:
            if mode not in a.modes.split(","):
                continue
            if mode == "strict":
                apply_strict(model)  # idempotent: once per precision in effect
            try:
                engine = (start_sglang(a, shape, precision, mode == "strict") if variant == "sglang" else
                          EmbeddedEngine(model, strict=mode == "strict", **VARIANTS[variant],
                                         **({"sampler": a.sampler} if variant != "megatron" else {})))
            except Exception as e:  # noqa: BLE001  (reported in the JSON; the next engines still run)
                doc["errors"].append({"precision": precision, "strict": mode == "strict", "variant": variant,
                                      "error": f"start: {type(e).__name__}: {e}"[:500]})
                print(f"{precision} {mode} {variant}: {doc['errors'][-1]['error']}", flush=True)
                write(out, doc)
                continue
            for i, batch in enumerate(batches):
                try:
                    row = measure_engine(engine, a, shape, precision, mode == "strict", batch)
                    if variant == "sglang":
                        row.update(variant=variant, startup_s=engine.startup_seconds, engine_args=engine.engine_args)
                        for key, from_gpu in (("weight_update", False), ("weight_update_from_gpu", True)):
                            if from_gpu and not torch.cuda.is_available():
                                continue
                            try:  # a failed update is recorded; the row's decode timing stays
                                row[f"{key}_s"] = time_update(engine, model, from_gpu=from_gpu)
                                row[f"{key}_phases_s"] = dict(engine.last_update_seconds)
                            except Exception as e:  # noqa: BLE001  (the engine kept its weights)
                                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
                            print(f"  sglang start {engine.startup_seconds:.1f} s, {key} "
                                  f"{row.get(f'{key}_s', float('nan')):.2f} s {row.get(f'{key}_phases_s')}", flush=True)
                    else:
                        row.update(variant=variant, cuda_graphs_replayed=engine.decoder.graphs > 0,
                                   graph_error=engine.decoder.graph_error)
                        if variant != "megatron":
                            row["sampler"] = engine.decoder.sampler
                    if i == 0 and variant != "sglang":  # once per engine: the count does not depend on the batch
                        row["host_syncs_per_step"] = host_syncs_per_step(engine, a, shape, batch)
                        if a.profile:
                            prompts = torch.randint(1, shape["vocab_size"], (batch, a.prompt_len)).tolist()
                            print_top(lambda e=engine: _timed_generate(e, prompts, a.new_tokens), a.profile,
                                      f"{precision} {mode} {variant} batch {batch}, {a.new_tokens} new tokens")
                    if mode == "strict":
                        row["strict_fused"] = a.strict_fused
                    doc["rows"].append(row)
                    print(f"{precision:5s} {mode:7s} {variant:8s} batch {batch:4d}: step {_ms(row['step_ms'])} "
                          f"(floor {_ms(row['floor_ms'])}), {row['decode_tokens_per_s']:,.0f} tokens/s", flush=True)
                except Exception as e:  # noqa: BLE001  (reported in the JSON; the next rows still run)
                    doc["errors"].append({"precision": precision, "strict": mode == "strict", "batch": batch,
                                          "variant": variant,
                                          "error": f"{type(e).__name__}: {e}"[:500]})
                    print(f"{precision} {mode} batch {batch}: {doc['errors'][-1]['error']}", flush=True)
                    _free()
                write(out, doc)
            if variant == "sglang":
                engine.shutdown()
            del engine
            _free()
        del model
        _free()


def start_sglang(a: argparse.Namespace, shape: dict, precision: str, strict: bool):
    """SGLang's engine with the plugin (rollout.backend=sglang) on this precision's config: build_sglang builds the
    model from the same seed as the embedded engine's, so both hold the same weights."""
    from minite.rollout.sglang.engine import build_sglang

    cfg = engine_config(a, shape, precision, ["rollout.backend=sglang", f"alignment.strict={str(strict).lower()}"])
    return build_sglang(cfg)


def time_update(engine, model, from_gpu: bool = False) -> float:
    """Seconds of one weight update of the SGLang engine from the embedded model's GPU tensors (validate, quantise,
    pack, send, reload the plugin's views), as an RL step does it; from_gpu: the packed tensors sent from the GPU
    (SGLangEngine.send_from_gpu). The phases land in engine.last_update_seconds."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    engine.send_from_gpu = from_gpu
    _sync()
    t = time.perf_counter()
    try:
        engine.update_weights(named)
    finally:
        engine.send_from_gpu = type(engine).send_from_gpu
    _sync()
    return time.perf_counter() - t


def run_reference(a: argparse.Namespace, shape: dict, doc: dict, out: Path) -> None:
    for batch in (int(b) for b in a.batches.split(",")):
        try:
            row = measure_reference(a, shape, batch)
            doc["reference_rows"].append(row)
            print(f"reference batch {batch:4d}: step {_ms(row['step_ms'])} (eager {_ms(row['eager_step_ms'])}, "
                  f"floor {_ms(row['floor_ms'])})", flush=True)
        except Exception as e:  # noqa: BLE001
            doc["errors"].append({"reference": True, "batch": batch, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"reference batch {batch}: {doc['errors'][-1]['error']}", flush=True)
        _free()
        write(out, doc)


def _ms(v: float) -> str:
    return f"{v:.2f} ms" if v >= 0.1 else f"{v:.3g} ms"


def latest(doc: dict) -> dict:
    """`doc` with only the newest row of each (precision, strict, batch) and reference row of each batch (rows are
    appended in the order they were measured, so the last one of a key is the newest) and no errors: the headline
    of docs/benchmarks.md's rollout section (each row still names its loop and commit)."""
    def last(rows, key):
        kept = {key(r): r for r in rows}  # a later row replaces an earlier one of its key, keeping its place
        return list(kept.values())
    return {**doc, "rows": last(doc["rows"], lambda r: (r["precision"], r["strict"], r["batch"])),
            "reference_rows": last(doc.get("reference_rows", []), lambda r: r["batch"]), "errors": []}


def _rates(doc: dict) -> str:
    """The floors' rates: the file's, and each other one a merged row carries (`hbm_bytes_per_s` per row)."""
    own = doc["hbm_bytes_per_s"]
    others = sorted({r["hbm_bytes_per_s"] for r in doc["rows"] if r.get("hbm_bytes_per_s", own) != own})
    return f"{own / 1e12:g} TB/s" + "".join(f" ({rate / 1e12:g} TB/s in the rows that record it)" for rate in others)


def render(doc: dict) -> str:
    """docs/benchmarks.md's table of one results file (numbers are never typed by hand)."""
    out = [f"Device {doc['device']}, last invocation {doc['date']} at commit {doc['commit']}: `{doc['command']}`. "
           "Each row names the commit it was measured at (rows of several invocations are merged by hand, "
           "`commit` per row). Decode step = (t(N_long) - t(N_short)) / (N_long - N_short) (loop megatron, and every row "
           "before 8fcedc1), or the CUDA-event time of the N_long run's decode steps over their count (miniTE's "
           "loop since 8fcedc1: the difference's noise, from the prefill, exceeded whole graph-replayed steps); floor = bytes a step "
           f"must read / {_rates(doc)}.", "",
           "Loop: megatron = Megatron-Core's controller (every row before the own loop), eager = miniTE's loop "
           "(minite/rollout/decode.py), graphs = miniTE's loop replaying CUDA graphs, NVFP4 GEMMs on fp16 block-value "
           "weights (what shipped until 2026-12-01; BF16: what ships), packed = graphs with rollout.packed_weights: "
           "the NVFP4 GEMMs read packed weight codes (before d5ff83e the dense linears' and the experts', since then "
           "the experts' only, in the decode order from cd42429 on, and from 86f56e4 the dense linears with "
           "K % 128 == 0 too; the default since 2026-12-01), sglang = SGLang's engine "
           "with the minite_nvfp4 plugin on the same weights (rollout.backend=sglang; decode step by the difference "
           "of the long and short runs); gumbel = miniTE's loop drew with rollout.sampler gumbel (one pass over the "
           "logits; the rows without it used Megatron's sampling ops); strict rows say whether minite.strict.fused's "
           "kernels ran (fused ops) or "
           "strict mode's torch ops alone (unfused ops; every strict row before 8cadb07).", "",
           "| precision | mode | loop | batch | prompt | new tokens | decode step | floor | step / floor "
           "| decode tokens/s | host syncs / step | commit |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(doc["rows"], key=lambda r: (r["precision"], r["strict"], r["batch"])):
        syncs = f"{r['host_syncs_per_step']:.1f}" if r.get("host_syncs_per_step") is not None else "-"
        loop = r.get("variant", "megatron")
        loop += " (none captured)" if VARIANTS.get(loop, {}).get("cuda_graphs") and not r.get("cuda_graphs_replayed") \
            else ""
        if r.get("sampler") == "gumbel":  # rows before the Gumbel sampler drew with Megatron's ops
            loop += ", gumbel"
        if "strict_fused" in r:  # strict rows since minite.strict.fused exists: with or without its kernels
            loop += ", fused ops" if r["strict_fused"] else ", unfused ops"
        out.append(f"| {r['precision'].upper()} | {'strict' if r['strict'] else 'default'} | {loop} | {r['batch']} | "
                   f"{r['prompt_len']} | {r['new_tokens']} | {_ms(r['step_ms'])} | {_ms(r['floor_ms'])} | "
                   f"{r['step_ms'] / r['floor_ms']:.1f}x | {r['decode_tokens_per_s']:,.0f} | {syncs} | "
                   f"{r.get('commit', doc['commit'])} |")
    if doc.get("reference_rows"):
        out += ["", "Plain-PyTorch BF16 decode step (tools/bench/decode_reference.py, random weights):", "",
                "| batch | context | step (CUDA graph) | eager step | floor | decode tokens/s | commit |",
                "|---|---|---|---|---|---|---|"]
        for r in sorted(doc["reference_rows"], key=lambda r: r["batch"]):
            graph = _ms(r["step_ms"]) if r["graph"] else "-"
            out.append(f"| {r['batch']} | {r['context']} | {graph} | {_ms(r['eager_step_ms'])} | "
                       f"{_ms(r['floor_ms'])} | {r['decode_tokens_per_s']:,.0f} | {r.get('commit', doc['commit'])} |")
    for e in doc.get("errors", []):
        out.append(f"\nFailed: {json.dumps({k: v for k, v in e.items() if k != 'error'})}: {e['error']}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if a.render:
        doc = json.loads(Path(a.render).read_text())
        print(render(latest(doc) if a.latest else doc), end="")
        return 0
    shape = TINY if a.tiny else FULL
    out = Path(a.out)
    from minite.strict import fused
    fused.ENABLED = a.strict_fused
    doc = {"device": device_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": commit(), "command": " ".join(shlex.quote(x) for x in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
           "torch": torch.__version__, "hbm_bytes_per_s": hbm_bytes_per_s(), "shape": dict(shape, num_layers=a.layers),
           "rows": [], "reference_rows": [], "errors": []}
    if not a.no_reference:
        run_reference(a, shape, doc, out)
    run_engines(a, shape, doc, out)
    write(out, doc)
    print(render(doc), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
