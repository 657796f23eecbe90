"""One learner step (forward + backward + Adam) for a slice of Qwen3-30B-A3B: NVFP4 vs BF16 tokens/s, on one GPU or
on several with expert parallelism (one sequence per GPU).

    python tools/bench/bench_learner_slice.py --layers 4 --seq 4096 --out slice.json     (on the H200)
    python tools/bench/bench_learner_slice.py --micro-batches 1,8 ...                      (+ the RL-sized row)
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench/bench_learner_slice.py --ep 2 \
        --layers 4 --seq 4096 --out slice-ep2.json                                       (two H200s, EP=2)
    python tools/bench/bench_learner_slice.py --tiny                                       (CPU smoke run)

Under torchrun every rank forwards its own sequences (data parallelism over the world; the experts split EP ways),
so tokens/s and model FLOP/s count the whole world's tokens; rank 0 prints and writes.

Full width (hidden 2048, 32 heads / 4 KV groups of 128, 128 experts top-8 of ffn 768, vocab 151936), `--layers`
layers, one sequence of `--seq` tokens, the real `minite.learner.Learner` (Megatron-Core local spec, the NVFP4 op
functions dispatching to the Triton kernels on CUDA). Reports the median step time over `--steps` after `--warmup`,
tokens/s and model FLOP/s (6 x active parameters per token + causal attention 6 x L x s x heads x head_dim), for
the whole step and for forward + backward alone (the optimizer's share, timed with synchronisations around
optimizer.step, is Adam over every expert's fp32 master weights: ~3e9 parameters at 4 layers, a fixed cost that a
step of one 4096-token sequence does not amortise). `--micro-batches 1,8` adds a row per count on the same learner:
a step of 8 sequences with gradient accumulation (Learner.train_step(micro_batches=8)) and one optimizer step, as a
real RL step amortises the optimizer. Each row's peak_mem_gib is torch's max_memory_allocated over that row's steps
(the learner's own state included), the larger of peak_fwd_bwd_gib (forward, loss and backward, up to the optimizer
step) and peak_optimizer_gib (the optimizer step and the rest of the train step after it); mem_start_gib is what
was allocated before the precision's learner was built (0 unless an earlier learner leaked; cuBLAS's workspaces,
which torch's allocator holds once a GEMM ran, are cleared first). `--memory-top N` records one more step's
allocations and prints the N allocation sites alive at its peak (tools/bench/memory_peak.py).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import torch

from memory_peak import print_memory_top  # tools/bench/, beside this script
from profiling import print_op_sites, print_phases, print_py_top, print_sync_sites, print_top
from provenance import emit, stamp
from shapes import FULL, TINY


def model_flops_per_token(m: dict, layers: int, seq: int) -> float:
    h, hd, heads, kv = m["hidden_size"], m["head_dim"], m["num_attention_heads"], m["num_query_groups"]
    attn_params = h * (heads + 2 * kv) * hd + heads * hd * h
    expert_params = m["moe_router_topk"] * 3 * h * m["moe_ffn_hidden_size"] + h * m["num_experts"]
    dense = layers * (attn_params + expert_params) + h * m["vocab_size"]
    attention = layers * 2 * 2 * (seq / 2) * heads * hd  # QK^T and PV over seq/2 keys on average (causal)
    return 3 * (2 * dense + attention)


def _profile_step(learner, tokens, top: int, micro: int = 1, memory_top: int = 0, sync_top: int = 0,
                  op_sites: str = "", phases: bool = False) -> None:
    """More steps of `micro` micro-batches: under torch.profiler and cProfile (tools/bench/profiling.py) if `top`, with
    the allocator's history (tools/bench/memory_peak.py: what is alive at the step's peak) if `memory_top`, with the
    host synchronisations counted by call site if `sync_top`, with the ops named in `op_sites` counted by call site,
    timed by phase (`phase_targets`) if `phases`."""
    step = lambda: learner.train_step(tokens, lambda lp: (-lp.mean() / micro, {}), micro_batches=micro)  # noqa: E731
    if top:
        print_top(step, top, "one train step", show=RANK0)
        print_py_top(step, top, "one train step", show=RANK0)
    if memory_top:
        print_memory_top(step, memory_top, f"one train step of {micro} micro-batches", show=RANK0)
    if sync_top:
        print_sync_sites(step, sync_top, f"in one train step of {micro} micro-batches", show=RANK0)
    if op_sites:
        print_op_sites(step, op_sites.split(","), top or 25, f"in one train step of {micro} micro-batches", show=RANK0)
    if phases:
        print_phases(step, phase_targets(learner), f"of one train step of {micro} micro-batches", show=RANK0)


def phase_targets(learner) -> list:
    """The train step's phases (Learner.train_step): each micro-batch's forward (the backward is the time after it),
    the NVFP4 weights' quantisation, release and restore, Megatron's gradient finalisation and the optimizer."""
    import megatron.core.distributed as mcd

    import minite.learner.learner as L
    import minite.megatron_patches.nvfp4_layers as NL
    return [(learner, "_batch_logprobs", "forward (log-probs)"), (learner.ddp, "zero_grad_buffer", "zero_grad_buffer"),
            (L, "release_quantised_weights", "release_quantised_weights"),
            (NL, "quantize_weights_now", "  quantize_weights_now (inside the release)"),
            (L, "release_weight_caches", "release_weight_caches"),
            (L, "restore_quantised_weights", "restore_quantised_weights"),
            (L, "detach_dispatcher_graphs", "detach_dispatcher_graphs"),
            (mcd, "finalize_model_grads", "finalize_model_grads"), (learner.optimizer, "step", "optimizer.step")]


RANK0 = int(os.environ.get("RANK", "0")) == 0


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _peak_gib(dev: str) -> float:
    """torch's max_memory_allocated since the last reset, in GiB (0 off CUDA); then reset it."""
    if dev != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def _time_steps(learner, tokens, micro: int, steps: int, warmup: int, dev: str) -> tuple[float, float, dict]:
    """Median (step s, optimizer s) over `steps` train steps after `warmup`, and the last step's metrics (with the
    peak memory of the forward/backward phase and of the optimizer phase, GiB, over all steps, and every timed step's
    and optimizer phase's seconds: `steps_s`, `optimizer_steps_s`); each step is `micro` micro-batches of one
    sequence (gradient accumulation), each loss its 1/micro share."""
    opt_times, times, step_fn = [], [], learner.optimizer.step
    peaks = {"peak_fwd_bwd_gib": 0.0, "peak_optimizer_gib": 0.0}

    def timed_step(*a, **k):  # the optimizer's share of the step (synchronised around it), and the phases' peaks
        _sync(dev)
        peaks["peak_fwd_bwd_gib"] = max(peaks["peak_fwd_bwd_gib"], _peak_gib(dev))
        t = time.perf_counter()
        out = step_fn(*a, **k)
        _sync(dev)
        opt_times.append(time.perf_counter() - t)
        return out  # the optimizer phase's peak is read at the next step's start (or after the last step)

    learner.optimizer.step = timed_step
    try:
        for i in range(warmup + steps):
            _sync(dev)
            # this step's forward/backward phase starts here: what was allocated since the last step's optimizer
            # step began is that phase's peak
            peaks["peak_optimizer_gib"] = max(peaks["peak_optimizer_gib"], _peak_gib(dev))
            t0 = time.perf_counter()
            metrics = learner.train_step(tokens, lambda lp: (-lp.mean() / micro, {}), micro_batches=micro)
            _sync(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        learner.optimizer.step = step_fn
    peaks["peak_optimizer_gib"] = max(peaks["peak_optimizer_gib"], _peak_gib(dev))
    opts = opt_times[warmup:warmup + steps]
    spread = {"steps_s": [round(t, 5) for t in times], "optimizer_steps_s": [round(t, 5) for t in opts]}
    return statistics.median(times), statistics.median(opts), {**metrics, **peaks, **spread}


class ExpertRows:
    """Rows (token-expert pairs) each rank's local experts computed in the forward passes since `reset`: under EP the
    ranks wait for each other at every all-to-all, so an imbalance costs the slower rank's extra expert time on both.
    Counted by a forward pre-hook on every `*.mlp.experts` module (its first input: the permuted local rows)."""

    def __init__(self, model: torch.nn.Module):
        self.rows = 0
        self.handles = [m.register_forward_pre_hook(self._count) for n, m in model.named_modules()
                        if n.endswith("mlp.experts")]

    def _count(self, module, args) -> None:
        self.rows += int(args[0].shape[0])

    def max_over_mean(self) -> float | None:
        """Max over ranks / mean over ranks of the rows counted (1.0: balanced); None for one rank."""
        if world_size() == 1 or not self.handles:
            return None
        t = torch.tensor([float(self.rows)], device="cuda" if torch.cuda.is_available() else "cpu")
        rows = [torch.zeros_like(t) for _ in range(world_size())]
        torch.distributed.all_gather(rows, t)
        rows = [float(r) for r in rows]
        return max(rows) / (sum(rows) / len(rows)) if sum(rows) else None

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _row_passes(micro: int, wgrad_passes, default) -> list:
    """The expert_wgrad_passes of the rows for `micro` micro-batches: each distinct effective value (a single
    micro-batch defers nothing), the default last (main() takes each count's last NVFP4 row for its ratios); [None]
    for BF16 (default None)."""
    if default is None:
        return [None]
    last = min(micro, default)
    return [p for p in dict.fromkeys(min(micro, p) for p in wgrad_passes if p is not None) if p != last] + [last]


@contextlib.contextmanager
def routing(ab: str, on: bool | None):
    """One row's kernel routing: `ab` (a kernel name of minite.strict.fused, proven or waiting) out of fused.PROVEN
    (on False) or in it (on True), as shipped for on None; restored afterwards."""
    from minite.strict import fused
    saved = fused.PROVEN
    if ab and on is not None:
        fused.PROVEN = (saved | {ab}) if on else (saved - {ab})
    try:
        yield
    finally:
        fused.PROVEN = saved


def run(precision: str, shape: dict, layers: int, seq: int, steps: int, warmup: int, micro_batches=(1,),
        profile_top: int = 0, ep: int = 1, profile_micro: int = 1, memory_top: int = 0,
        sync_top: int = 0, op_sites: str = "", phases: bool = False, wgrad_passes=(None,), ab: str = "",
        ab_rounds: int = 2) -> list[dict]:
    """One learner, one row per micro-batch count: a step of `micro` x `seq` tokens and one optimizer step. With `ab`
    (a kernel name of minite.strict.fused), each row `ab_rounds` times without that kernel routed and with it,
    interleaved on the same learner (off, on, off, on, ...), each row naming its side in `ab`."""
    from minite.config import load_config
    from minite.learner.learner import Learner

    sets = [f"model.{k}={v}" for k, v in shape.items()]
    sets += [f"model.num_layers={layers}", f"model.max_position_embeddings={seq + 1}", f"precision.mode={precision}",
             f"parallel.ep={ep}"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gc.collect()
    if dev == "cuda":  # what an earlier precision's learner left allocated would show as mem_start_gib
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS's workspaces (the allocator's, ~64 MiB):
            torch._C._cuda_clearCublasWorkspaces()              # each learner counts the ones it allocates itself
        torch.cuda.empty_cache()
    mem_start = torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else None
    learner = Learner(load_config(None, sets))
    world = world_size()  # every rank its own sequences: the world is the data-parallel size (TP = PP = 1 here)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, shape["vocab_size"], (world * max(micro_batches), seq + 1), generator=gen).to(dev)
    rows = []
    nvfp4 = learner.nvfp4
    default = nvfp4.expert_wgrad_passes if nvfp4 is not None else None
    sides = [False, True] * ab_rounds if ab else [None]
    combos = [(m, p, on) for m in micro_batches for p in _row_passes(m, wgrad_passes, default) for on in sides]
    for micro, passes, on in combos:
        if passes is not None:  # NVFP4Context.expert_wgrad_passes for this row
            nvfp4.expert_wgrad_passes = passes
        if dev == "cuda":  # each row's own peak (the learner's state included)
            torch.cuda.reset_peak_memory_stats()
        counter = ExpertRows(learner.model)
        with routing(ab, on):
            step, opt, metrics = _time_steps(learner, tokens[:world * micro], micro, steps, warmup, dev)
        peak = max(metrics["peak_fwd_bwd_gib"], metrics["peak_optimizer_gib"])  # the phases' resets lose the max
        balance = counter.max_over_mean()
        counter.close()
        flops = model_flops_per_token(shape, layers, seq) * seq * micro * world
        rows.append({"precision": precision, "gpus": world if dev == "cuda" else 0,
                     "layout": f"ep{ep}" if ep > 1 else "single", "micro_batches": micro,
                     "tokens": world * micro * seq, "step_s": step, "tokens_per_s": world * micro * seq / step, "loss": metrics["loss"],
                     "model_tflops": flops / step / 1e12, "optimizer_s": opt, "fwd_bwd_s": step - opt,
                     "fwd_bwd_model_tflops": flops / (step - opt) / 1e12,
                     "peak_mem_gib": peak if dev == "cuda" else None,
                     "peak_fwd_bwd_gib": metrics["peak_fwd_bwd_gib"] if dev == "cuda" else None,
                     "peak_optimizer_gib": metrics["peak_optimizer_gib"] if dev == "cuda" else None,
                     "mem_start_gib": mem_start, "expert_rows_max_over_mean": balance,
                     "expert_wgrad_passes": passes, **({"ab": f"{ab}:{'on' if on else 'off'}"} if ab else {}),
                     # every timed step (the median above): the step moves by up to ~15% between runs of one tree on
                     # the H200 (docs/benchmarks.md, issue 17 in the twenty-second session)
                     "steps_s": metrics["steps_s"], "optimizer_steps_s": metrics["optimizer_steps_s"]})
        if RANK0:
            print(json.dumps(rows[-1]), flush=True)
    if profile_top or memory_top or sync_top or op_sites or phases:
        try:  # a failing profile must not lose the rows timed above
            _profile_step(learner, tokens[:world * profile_micro], profile_top, profile_micro, memory_top, sync_top,
                          op_sites, phases)
        except Exception as e:
            print(f"profile failed: {type(e).__name__}: {e}", flush=True)
    if nvfp4 is not None:
        nvfp4.expert_wgrad_passes = default
    learner.close()  # without it Megatron's DDP hooks keep the model, gradients and masters alive (Learner.close)
    del learner
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--micro-batches", default="1", help="comma list: one row per count, each step that many "
                   "sequences of --seq tokens with gradient accumulation and one optimizer step (RL-sized: 8)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (run under torchrun with that many ranks)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="after timing, profile one more step and print the TOP ops by device and host time")
    p.add_argument("--profile-micro-batches", type=int, default=1, metavar="N",
                   help="the profiled step's micro-batches of one sequence per rank (at most the largest count)")
    p.add_argument("--memory-top", type=int, default=0, metavar="N",
                   help="after timing, record one more step's allocations and print the N allocation sites alive at "
                   "its memory peak (CUDA; the step has --profile-micro-batches micro-batches)")
    p.add_argument("--sync-sites", type=int, default=0, metavar="N",
                   help="after timing, run one more step (--profile-micro-batches micro-batches) in torch's CUDA sync "
                   "debug mode and print the N call sites with the most host synchronisations")
    p.add_argument("--op-sites", default="", metavar="OPS",
                   help="after timing, run one more step (--profile-micro-batches) under a dispatch mode and print "
                   "where the comma-listed ops (e.g. aten::copy_,aten::_to_copy) were called from, bytes and time")
    p.add_argument("--phases", action="store_true",
                   help="after timing, one more step (--profile-micro-batches) timed by phase: each micro-batch's "
                   "forward and backward, the NVFP4 weights' quantisation, gradient finalisation, the optimizer")
    p.add_argument("--wgrad-passes", default="",
                   help="NVFP4: comma list of NVFP4Context.expert_wgrad_passes, one row each per micro-batch count "
                   "(1: each micro-batch's expert wgrad added into main_grad at once; the same bits either way)")
    p.add_argument("--ab", default="", metavar="KERNEL",
                   help="a kernel name of minite.strict.fused (PROVEN or waiting, e.g. expert_swiglu): every row "
                   "--ab-rounds times without it routed and with it, interleaved on one learner (key `ab` of a row; "
                   "the NVFP4/BF16 ratios take each count's last row, a routed one). Decode-only names (combine, "
                   "compact_with_graphs) change nothing in a learner step")
    p.add_argument("--ab-rounds", type=int, default=2)
    a = p.parse_args()
    if a.ab_rounds < 1:
        p.error(f"--ab-rounds must be >= 1, got {a.ab_rounds}")
    if a.ab:
        from minite.strict import fused
        if a.ab not in fused.PROVEN | fused.WAITING:
            p.error(f"--ab {a.ab}: not a kernel name of minite.strict.fused (those are "
                    f"{', '.join(sorted(fused.PROVEN | fused.WAITING))})")
    shape = TINY if a.tiny else FULL
    micro = tuple(int(m) for m in a.micro_batches.split(","))
    rows = []
    for prec in a.precisions.split(","):
        try:
            rows += run(prec, shape, a.layers, a.seq, a.steps, a.warmup, micro, a.profile, a.ep,
                        a.profile_micro_batches, a.memory_top, a.sync_sites, a.op_sites, a.phases,
                        tuple(int(v) for v in a.wgrad_passes.split(",")) if a.wgrad_passes else (None,), a.ab,
                        a.ab_rounds)
        except Exception as e:  # report and go on: one precision failing must not hide the other's number
            rows.append({"precision": prec, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    ok = {(r["precision"], r["micro_batches"]): r for r in rows if "error" not in r}  # each count's last row

    def ratio(m):
        both = ok.get(("nvfp4", m)), ok.get(("bf16", m))
        return both[0]["tokens_per_s"] / both[1]["tokens_per_s"] if all(both) else None

    if not RANK0:
        return
    result = {"layers": a.layers, "seq": a.seq, "ep": a.ep, "rows": rows, "nvfp4_over_bf16_tokens_per_s": ratio(micro[0]),
              "nvfp4_over_bf16_tokens_per_s_by_micro_batches": {str(m): ratio(m) for m in micro},
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **stamp()}
    emit(result, a.out)


if __name__ == "__main__":
    main()
