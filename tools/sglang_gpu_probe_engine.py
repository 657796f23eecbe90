"""One phase of tools/sglang_gpu_probe.py, run in a process of its own so that a crash, a hang or SGLang's import
side effects stay inside it. It rewrites its JSON file after every step, so a phase killed at its time limit still
leaves the steps it finished.

    python tools/sglang_gpu_probe_engine.py imports --json F
    python tools/sglang_gpu_probe_engine.py plugin_graphs --json F
    python tools/sglang_gpu_probe_engine.py engine --json F [--graphs] [--deterministic] [--bf16]

`imports`: imports SGLang's GPU-path modules one by one and records, for each failure, the exception and the chain
of SGLang source lines that led to it; on a GPU it then builds one of SGLang's JIT kernels (nvcc).
`plugin_graphs`: the plugin's linear and MoE computations on the GPU without SGLang, eager and inside a captured CUDA
graph. `engine`: the same imports, then the tiny random Qwen3-MoE of the SGLang tests (tests/rollout/sglang/conftest.py)
is started with `minite.rollout.sglang.engine.start_from_learner_tensors` (quantization="minite_nvfp4", or a BF16
checkpoint with --bf16; on a GPU attention_backend="triton", sampling_backend="pytorch"), generates with log-probs,
and takes weight updates from CPU tensors (the production path) and from CUDA tensors. Which sgl_kernel stand-in and
which fused-op backend are in force is the caller's choice, through the environment (tools/sglang_gpu_probe.py).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # for tests.rollout.sglang (the tiny model, test tooling); last, so that an installed
    sys.path.append(str(ROOT))  # minite (with its kernels/ and megatron_patches/ mapped in) comes first

# The modules a Qwen3-MoE model with the minite_nvfp4 plugin, triton attention and CUDA graphs goes through.
GPU_MODULES = [
    "sglang",
    "sglang.srt.utils",
    "sglang.srt.layers.quantization",
    "sglang.srt.layers.quantization.modelopt_quant",
    "sglang.srt.layers.linear",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.layers.rotary_embedding",
    "sglang.srt.layers.vocab_parallel_embedding",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.moe.topk",
    "sglang.srt.layers.moe.fused_moe_triton",
    "sglang.srt.layers.moe.fused_moe_triton.layer",
    "sglang.srt.layers.radix_attention",
    "sglang.srt.layers.attention.attention_registry",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.kernels.ops.attention.extend_attention",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.eager_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.scheduler",
    "sglang.srt.entrypoints.engine",
    "minite.rollout.sglang.plugin",
    "minite.rollout.sglang.methods",
    "minite.rollout.sglang.engine",
]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def error_record(e: BaseException) -> dict:
    """The exception text, and the SGLang / miniTE source lines of its traceback (the import or call chain)."""
    frames = traceback.extract_tb(e.__traceback__)
    chain = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}: {(f.line or '').strip()}" for f in frames
             if "sglang" in f.filename or "minite" in f.filename or "sgl_kernel" in f.filename]
    return {"error": f"{type(e).__name__}: {str(e).strip()}"[:3000], "chain": chain[-12:],
            "traceback_tail": "".join(traceback.format_exception(e))[-4000:]}


class StepTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise StepTimeout("step timed out")


class Recorder:
    """Steps with a time limit each (SIGALRM, main thread); the JSON file is rewritten after every step."""

    def __init__(self, path: str, **meta):
        self.path, self.data = path, {**meta, "steps": []}
        signal.signal(signal.SIGALRM, _alarm)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def step(self, name: str, fn, timeout: int, keep: bool = False):
        """fn() under a time limit; its value is returned (None on failure) and, with keep, recorded."""
        row = {"step": name, "ok": False}
        t0 = time.perf_counter()
        signal.alarm(max(1, int(timeout)))
        try:
            value = fn()
            row["ok"] = True
            if keep:
                row["value"] = value
            return value
        except BaseException as e:  # noqa: BLE001 - every failure is the measurement; the next step still runs
            row.update(error_record(e))
            if isinstance(e, KeyboardInterrupt):
                raise
            return None
        finally:
            signal.alarm(0)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            self.data["steps"].append(row)
            self.write()


def check_imports(rec: Recorder) -> dict:
    results = {}
    for mod in GPU_MODULES:
        t0 = time.perf_counter()
        try:
            importlib.import_module(mod)
            results[mod] = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - an import may fail with anything; record it and go on
            results[mod] = {"ok": False, **error_record(e)}
        results[mod]["seconds"] = round(time.perf_counter() - t0, 2)
    rec.data["imports"] = results
    rec.write()
    return results


# On a GPU the tiny model gets head_dim 64 (SGLang's Triton attention kernels are tuned for 64..256) and widths of 128+.
GPU_SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=128, moe_intermediate_size=128, head_dim=64)


def build_one_jit_kernel() -> dict:
    """SGLang's own CUDA kernels that are not in sgl_kernel are compiled on first use (nvcc through tvm-ffi): build
    one, the KV-cache store every CUDA model uses (SGLang falls back to PyTorch, with a warning, if it fails)."""
    from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

    t0 = time.perf_counter()
    _jit_kvcache_module(256, 256, 0)  # head_dim 64 x 2 KV heads x bf16 per row
    return {"kernel": "kvcache store_cache", "seconds": round(time.perf_counter() - t0, 1)}


def tiny_learner_tensors(tmp: Path, seed: int):
    """The SGLang tests' tiny random Qwen3-MoE (transformers writes it; no downloads) as the learner names it."""
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf
    from tests.rollout.sglang.conftest import tiny_hf_checkpoint

    shape = GPU_SHAPE if torch.cuda.is_available() else {}
    hf_dir = tiny_hf_checkpoint(tmp / f"w{seed}", seed=seed, **shape)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    return cfg, [(n, t.clone()) for n, t in megatron_view_of_hf(_HFReader(hf_dir), cfg)]


def engine_args(gpu: bool, graphs: bool, deterministic: bool) -> dict:
    if not gpu:  # SGLangEngine's CPU defaults (torch_native attention, no graphs)
        return {"log_level": "warning"}
    # disable_radix_cache: the third probe's first prefill finished, then SGLang's radix cache (its compiled Rust tree
    # core, mem_cache.cpython-*.so, built for torch 2.14) refused the int64 KV indices under the device's torch 2.11
    # ("insert value must be an int64 tensor, got Int"); an RL rollout gains nothing from prefix caching across
    # weight versions (every update flushes the cache)
    args = {"attention_backend": "triton", "sampling_backend": "pytorch", "mem_fraction_static": 0.3,
            "max_total_tokens": 8192, "log_level": "warning", "disable_radix_cache": True,
            "enable_deterministic_inference": deterministic, "disable_cuda_graph": not graphs}
    if graphs:
        args.update(cuda_graph_bs_decode=[1, 2, 4, 8], disable_prefill_cuda_graph=True)
    return args


def _outs(results):
    return [(r.prompt_index, r.tokens, r.logprobs, r.finished) for r in results]


def run_engine(rec: Recorder, graphs: bool, deterministic: bool, start_timeout: int, bf16: bool = False) -> None:
    gpu = torch.cuda.is_available()
    rec.data["gpu"] = torch.cuda.get_device_name(0) if gpu else None
    check_imports(rec)
    tmp = Path(tempfile.mkdtemp(prefix="sglang-gpu-probe-"))
    tensors = rec.step("tiny_checkpoint", lambda: (tiny_learner_tensors(tmp, 1), tiny_learner_tensors(tmp, 2)), 120)
    if tensors is None:
        return
    (cfg, w1), (_, w2) = tensors
    from minite.nvfp4 import NVFP4Recipe
    from minite.rollout.base import SamplingParams

    backend = rec.step("import_minite_sglang_backend", lambda: importlib.import_module("minite.rollout.sglang.engine"),
                       120)
    if backend is None:
        return
    args = engine_args(gpu, graphs, deterministic)
    rec.data["engine_args"] = args
    recipe = None if bf16 else NVFP4Recipe()  # None: a BF16 checkpoint on SGLang's own layers, no plugin method
    eng = rec.step("engine_start", lambda: backend.start_from_learner_tensors(w1, cfg, recipe, engine_args=args),
                   start_timeout)
    if eng is None:
        return
    try:
        greedy = SamplingParams(temperature=1e-6, max_new_tokens=8, n=2, seed=7)
        first = rec.step("generate_greedy_logprobs", lambda: _outs(eng.generate(PROMPTS, greedy)), 120, keep=True)
        again = rec.step("generate_greedy_again", lambda: _outs(eng.generate(PROMPTS, greedy)), 60)
        rec.data["greedy_reproducible"] = first is not None and again == first

        sampled = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=11)
        s1 = rec.step("generate_sampled", lambda: _outs(eng.generate(PROMPTS, sampled)), 60)
        s2 = rec.step("generate_sampled_again", lambda: _outs(eng.generate(PROMPTS, sampled)), 60)
        rec.data["sampled_reproducible"] = s1 is not None and s1 == s2

        def rate():
            batch = SamplingParams(temperature=1e-6, max_new_tokens=32, n=2, seed=3)  # 8 sequences: a graph size
            prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = eng.generate(prompts, batch)
            dt = time.perf_counter() - t0
            return {"sequences": len(out), "tokens": sum(len(r.tokens) for r in out), "seconds": round(dt, 3),
                    "tokens_per_s": round(sum(len(r.tokens) for r in out) / dt, 1)}
        rec.step("tiny_batch_rate", rate, 60, keep=True)

        rec.step("update_weights_cpu_tensors", lambda: eng.update_weights(w2), 60)
        after = rec.step("generate_after_update", lambda: _outs(eng.generate(PROMPTS, greedy)), 60)
        rec.data["update_changed_output"] = after is not None and after != first

        def gpu_update():
            packed = eng.pack(eng.validate(w1))
            dev = [(n, t.cuda()) for n, t in packed] if gpu else packed
            ok, msg = eng._load(dev)  # begin -> update_weights_from_tensor(CUDA tensors) -> end
            if not ok:
                raise RuntimeError(f"update_weights_from_tensor with {'CUDA' if gpu else 'CPU'} tensors: {msg}")
            return {"tensors": len(dev), "device": str(dev[0][1].device)}
        rec.step("update_weights_gpu_tensors", gpu_update, 60, keep=True)
        back = rec.step("generate_after_round_trip", lambda: _outs(eng.generate(PROMPTS, greedy)), 60)
        rec.data["round_trip_bitwise"] = back is not None and back == first
    finally:
        rec.step("shutdown", eng.shutdown, 30)


def _experts(cfg: dict) -> int:
    return cfg.get("num_local_experts", cfg.get("num_experts"))  # transformers renamed it in 5.x


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def plugin_layer_weights(cfg: dict, w1, dev: str):
    """Layer 0 of the tiny model as the plugin holds it after SGLang's loaders: o_proj as one NVFP4Tensor and the
    experts as two NVFP4Stacks over stacked ModelOpt tensors (w13 = gate|up per expert, w2 = down)."""
    from minite.convert.export_nvfp4 import pack_megatron_weights
    from minite.nvfp4 import NVFP4Recipe
    from minite.nvfp4.modelopt import expert_stack, weight_tensor

    packed = {n: t.to(dev) for n, t in pack_megatron_weights(w1, cfg, NVFP4Recipe())}
    pre = "model.layers.0."
    o = pre + "self_attn.o_proj."
    lin = weight_tensor(packed[o + "weight"], packed[o + "weight_scale"], packed[o + "weight_scale_2"].reshape(1),
                        None, packed[o + "weight_scale_amax"].reshape(1))

    def stack(projs, suffix):
        per_expert = [[_u8(packed[f"{pre}mlp.experts.{e}.{p}.{suffix}"]) for p in projs]
                      for e in range(_experts(cfg))]
        if per_expert[0][0].dim() == 0:  # global scales / amaxes: [E, shards]
            return torch.stack([torch.stack(ts) for ts in per_expert]).float()
        out = torch.stack([torch.cat(ts) for ts in per_expert])
        return out.view(torch.float8_e4m3fn) if suffix == "weight_scale" else out

    sfx = ("weight", "weight_scale", "weight_scale_2", "weight_scale_amax")
    w13 = expert_stack(*(stack(("gate_proj", "up_proj"), x) for x in sfx))
    w2 = expert_stack(*(stack(("down_proj",), x) for x in sfx))
    return lin, w13, w2


def run_plugin_graphs(rec: Recorder) -> None:
    """The plugin's two computations (MiniteNVFP4LinearMethod.apply, MiniteNVFP4MoEMethod.apply) on the GPU without
    SGLang: eager, then captured in a CUDA graph and replayed (a host synchronisation inside breaks the capture)."""
    from minite.nvfp4 import NVFP4Recipe  # SGLang-free, as are the two below
    from minite.ops import nvfp4_linear_forward
    from minite.rollout.sglang.common import grouped_forward

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    rec.data["gpu"] = torch.cuda.get_device_name(0) if gpu else None
    tmp = Path(tempfile.mkdtemp(prefix="sglang-gpu-probe-"))
    cfg, w1 = tiny_learner_tensors(tmp, 1)
    got = rec.step("tiny_weights", lambda: plugin_layer_weights(cfg, w1, dev), 120)
    if got is None:
        return
    lin, w13, w2 = got
    recipe, g = NVFP4Recipe(), torch.Generator(device="cpu").manual_seed(0)
    m, k, e = 8, cfg["num_experts_per_tok"], _experts(cfg)  # a decode batch of 8 tokens
    x = (torch.randn(m, cfg["hidden_size"], generator=g) * 0.5).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(dev)
    probs = torch.softmax(torch.randn(m, k, generator=g), -1).to(dev)
    cases = {"linear": lambda: nvfp4_linear_forward(x, lin, recipe, backend="auto"),
             "moe": lambda: grouped_forward(x, w13, w2, probs, ids, recipe, backend="auto")}
    for name, fn in cases.items():
        ref = rec.step(f"{name}_eager", fn, 120)
        if ref is None or not gpu:
            continue

        def capture(fn=fn, ref=ref):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            torch.cuda.synchronize()
            return {"replay_bitwise_equal_eager": bool(torch.equal(out, ref))}
        rec.step(f"{name}_cuda_graph_capture", capture, 60, keep=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["imports", "plugin_graphs", "engine"])
    p.add_argument("--json", required=True)
    p.add_argument("--graphs", action="store_true", help="CUDA graphs on (decode, batch sizes 1, 2, 4, 8)")
    p.add_argument("--deterministic", action="store_true", help="enable_deterministic_inference")
    p.add_argument("--bf16", action="store_true", help="a BF16 checkpoint without the plugin (SGLang's own layers)")
    p.add_argument("--start-timeout", type=int, default=150)
    a = p.parse_args(argv)
    rec = Recorder(a.json, mode=a.mode, graphs=a.graphs, deterministic=a.deterministic, bf16=a.bf16, pid=os.getpid(),
                   env={k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "MINITE_"))})
    if a.mode == "imports":
        check_imports(rec)
        if torch.cuda.is_available():
            rec.step("jit_kernel_build", build_one_jit_kernel, 120, keep=True)
    elif a.mode == "plugin_graphs":
        run_plugin_graphs(rec)
    else:
        run_engine(rec, a.graphs, a.deterministic, a.start_timeout, a.bf16)
    rec.data["finished"] = True
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
