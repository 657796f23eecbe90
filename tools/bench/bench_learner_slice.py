"""One learner step (forward + backward + Adam) on one GPU for a slice of Qwen3-30B-A3B: NVFP4 vs BF16 tokens/s.

    python tools/bench/bench_learner_slice.py --layers 4 --seq 4096 --out slice.json     (on the H200)
    python tools/bench/bench_learner_slice.py --tiny                                       (CPU smoke run)

Full width (hidden 2048, 32 heads / 4 KV groups of 128, 128 experts top-8 of ffn 768, vocab 151936), `--layers`
layers, one sequence of `--seq` tokens, the real `minite.learner.Learner` (Megatron-Core local spec, the NVFP4 op
functions dispatching to the Triton kernels on CUDA). Reports the median step time over `--steps` after `--warmup`,
tokens/s and model FLOP/s (6 x active parameters per token + causal attention 6 x L x s x heads x head_dim), for
the whole step and for forward + backward alone (the optimizer's share, timed with synchronisations around
optimizer.step, is Adam over every expert's fp32 master weights: ~3e9 parameters at 4 layers, a fixed cost that a
step of one 4096-token sequence does not amortise).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

FULL = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_query_groups=4, head_dim=128,
            num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
TINY = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


def model_flops_per_token(m: dict, layers: int, seq: int) -> float:
    h, hd, heads, kv = m["hidden_size"], m["head_dim"], m["num_attention_heads"], m["num_query_groups"]
    attn_params = h * (heads + 2 * kv) * hd + heads * hd * h
    expert_params = m["moe_router_topk"] * 3 * h * m["moe_ffn_hidden_size"] + h * m["num_experts"]
    dense = layers * (attn_params + expert_params) + h * m["vocab_size"]
    attention = layers * 2 * 2 * (seq / 2) * heads * hd  # QK^T and PV over seq/2 keys on average (causal)
    return 3 * (2 * dense + attention)


def _profile_step(learner, tokens, top: int) -> None:
    """One more step under torch.profiler: the `top` ops by self device time and by self host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        learner.train_step(tokens, lambda lp: (-lp.mean(), {}))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ka = prof.key_averages()
    dev_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(ka.table(sort_by=dev_key, row_limit=top, max_name_column_width=60), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60), flush=True)


def run(precision: str, shape: dict, layers: int, seq: int, steps: int, warmup: int, profile_top: int = 0) -> dict:
    from minite.config import load_config
    from minite.learner.learner import Learner

    sets = [f"model.{k}={v}" for k, v in shape.items()]
    sets += [f"model.num_layers={layers}", f"model.max_position_embeddings={seq + 1}", f"precision.mode={precision}"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":  # this row's peak only: what an earlier row left allocated shows as mem_start_gib
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    mem_start = torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else None
    learner = Learner(load_config(None, sets))
    tokens = torch.randint(1, shape["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    opt_times = []
    step_fn = learner.optimizer.step

    def timed_step(*a, **k):  # the optimizer's share of the step (synchronised around it)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = step_fn(*a, **k)
        if dev == "cuda":
            torch.cuda.synchronize()
        opt_times.append(time.perf_counter() - t)
        return out

    learner.optimizer.step = timed_step
    times = []
    for i in range(warmup + steps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = learner.train_step(tokens, lambda lp: (-lp.mean(), {}))
        if dev == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    opt = statistics.median(opt_times[warmup:warmup + steps])
    if profile_top:
        _profile_step(learner, tokens, profile_top)
    flops = model_flops_per_token(shape, layers, seq) * seq
    out = {"precision": precision, "step_s": step, "tokens_per_s": seq / step, "loss": metrics["loss"],
           "model_tflops": flops / step / 1e12, "optimizer_s": opt, "fwd_bwd_s": step - opt,
           "fwd_bwd_model_tflops": flops / (step - opt) / 1e12,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
           "mem_start_gib": mem_start}
    learner.optimizer.step = step_fn
    learner.close()  # without it Megatron's DDP hooks keep the model, gradients and masters alive (Learner.close)
    del learner
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="after timing, profile one more step and print the TOP ops by device and host time")
    a = p.parse_args()
    shape = TINY if a.tiny else FULL
    rows = []
    for prec in a.precisions.split(","):
        try:
            rows.append(run(prec, shape, a.layers, a.seq, a.steps, a.warmup, a.profile))
        except Exception as e:  # report and go on: one precision failing must not hide the other's number
            rows.append({"precision": prec, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
    ok = {r["precision"]: r for r in rows if "error" not in r}
    ratio = ok["nvfp4"]["tokens_per_s"] / ok["bf16"]["tokens_per_s"] if {"bf16", "nvfp4"} <= set(ok) else None
    result = {"layers": a.layers, "seq": a.seq, "rows": rows, "nvfp4_over_bf16_tokens_per_s": ratio,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
