"""Alignment measurements in one run (for one H200 call, or a CPU smoke run): log-prob gap table and the
strict-mode decode overhead of the embedded rollout engine. Writes JSON lines to --out as it goes (a run cut short
still leaves its finished rows).

    python tools/alignment_gpu.py --out /tmp/align.jsonl                # GPU: medium + tiny model
    python tools/alignment_gpu.py --out /tmp/a.jsonl --quick            # CPU smoke run (tiny only, small bench)

Gap rows: learner vs embedded engine, `minite.alignment.diagnose.diagnose_pair`, for BF16/NVFP4 x
default / routing replay / strict. Throughput: decode tokens/s of engine.generate, isolated from prefill as
B * (n2 - n1) / (t(n2) - t(n1)) over two generate lengths (each timed after a warm-up, CUDA-synchronised).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

import torch

MEDIUM = ["model.vocab_size=8192", "model.hidden_size=1024", "model.num_layers=4", "model.num_attention_heads=16",
          "model.num_query_groups=4", "model.head_dim=64", "model.num_experts=32", "model.moe_router_topk=4",
          "model.moe_ffn_hidden_size=512", "model.max_position_embeddings=256"]
MODES = {"default": [], "replay": ["alignment.routing_replay=true"], "strict": ["alignment.strict=true"]}


def _emit(out: str, row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k != "ops"}), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gap_rows(out: str, model: str, sets: list[str], prompts: int, new: int, modes: list[str]) -> None:
    from minite.alignment.diagnose import DiagnoseParams, build_pair, diagnose_pair
    from minite.config import load_config

    for prec in ("bf16", "nvfp4"):
        for mode in modes:
            try:
                cfg = load_config("examples/tiny/nvfp4.yaml", sets + [f"precision.mode={prec}"] + MODES[mode])
                learner, engine = build_pair(cfg)
                t = time.perf_counter()
                r = diagnose_pair(learner, engine, cfg, DiagnoseParams(num_prompts=prompts, max_new_tokens=new,
                                                                        max_prompt_len=12))
                r.update(kind="gap", model=model, mode=mode, seconds=round(time.perf_counter() - t, 2))
                first = [d for d in r["ops"] if d["max_abs"] > 0][:3]
                r["first_ops"] = first
                _emit(out, r)
                del learner, engine
            except Exception as e:  # keep going: one failing row must not cost the others
                _emit(out, {"kind": "gap", "model": model, "precision": prec, "mode": mode, "error": repr(e),
                            "trace": traceback.format_exc()[-2000:]})


def _timed_generate(engine, prompts, new: int) -> float:
    from minite.rollout.base import SamplingParams

    sp = SamplingParams(max_new_tokens=new, seed=0)
    _sync()
    t = time.perf_counter()
    engine.generate(prompts, sp)
    _sync()
    return time.perf_counter() - t


def throughput_rows(out: str, model: str, sets: list[str], batch: int, plen: int, n1: int, n2: int) -> None:
    from minite.config import load_config
    from minite.rollout import make_engine

    g = torch.Generator().manual_seed(0)
    for prec in ("bf16", "nvfp4"):
        for mode in ("default", "strict"):
            try:
                cfg = load_config("examples/tiny/nvfp4.yaml", sets + [f"precision.mode={prec}"] + MODES[mode])
                engine = make_engine(cfg)
                vocab = cfg.model.vocab_size
                prompts = [torch.randint(1, vocab, (plen,), generator=g).tolist() for _ in range(batch)]
                _timed_generate(engine, prompts, n1)  # warm-up (Triton compiles, allocator)
                t1 = min(_timed_generate(engine, prompts, n1) for _ in range(2))
                t2 = min(_timed_generate(engine, prompts, n2) for _ in range(2))
                tps = batch * (n2 - n1) / max(t2 - t1, 1e-9)
                _emit(out, {"kind": "decode", "model": model, "precision": prec, "mode": mode, "batch": batch,
                            "prompt_len": plen, "n1": n1, "n2": n2, "t1": t1, "t2": t2,
                            "decode_tokens_per_s": tps, "ms_per_step": 1e3 * (t2 - t1) / (n2 - n1)})
                del engine
            except Exception as e:
                _emit(out, {"kind": "decode", "model": model, "precision": prec, "mode": mode, "error": repr(e),
                            "trace": traceback.format_exc()[-2000:]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, small benchmark")
    ap.add_argument("--skip-gaps", action="store_true")
    ap.add_argument("--round2", action="store_true",
                    help="strict-mode rows only (medium model gaps) and the decode benchmark, shorter")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from minite.megatron_patches import cpu as cpu_patches

    cpu_patches._patch_te_general_gemm()  # 0.16.1 leaves it undefined without TE, on GPU too
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    _emit(args.out, {"kind": "device", "device": dev, "torch": torch.__version__,
                     "commit": os.environ.get("MINITE_COMMIT", "?"), "date": time.strftime("%Y-%m-%d %H:%M UTC")})
    tiny = ["model.max_position_embeddings=64"]
    if args.quick:
        if not args.skip_gaps:
            gap_rows(args.out, "tiny", tiny, 4, 4, ["default", "strict"])
        throughput_rows(args.out, "tiny", tiny, batch=4, plen=4, n1=2, n2=6)
        return 0
    if args.round2:
        gap_rows(args.out, "medium", MEDIUM, 16, 16, ["strict"])
        throughput_rows(args.out, "medium", MEDIUM, batch=32, plen=16, n1=8, n2=24)
        return 0
    if not args.skip_gaps:
        gap_rows(args.out, "medium", MEDIUM, 16, 16, ["default", "replay", "strict"])
    throughput_rows(args.out, "medium", MEDIUM, batch=32, plen=16, n1=8, n2=40)
    if not args.skip_gaps:
        gap_rows(args.out, "tiny", tiny, 8, 6, ["default", "strict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
