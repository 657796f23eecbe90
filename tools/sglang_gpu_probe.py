"""SGLang 0.5.23 on a GPU machine as it is (no sglang-kernel, no flashinfer, the image's torch): what imports, what
runs, what blocks, with the minite_nvfp4 plugin. One call of tools/sglang_gpu_probe.sh runs this; it writes
probe.json (rewritten after every step) and probe.log (each phase's output) to --out and prints a table.

    python tools/sglang_gpu_probe.py --out DIR [--budget 200]          # GPU machine (or a CPU dry run)
    python tools/sglang_gpu_probe.py --out DIR --cpu-engine             # CPU: run the engine phase on the CPU engine

Steps, in order; each is timed, each failure is recorded with its exception text, and the next step still runs:
1. environment: Python, GPU, nvcc, and the versions of the packages SGLang's GPU path depends on;
2. static scan of SGLang's source: every `sgl_kernel` import (module level or inside a function) and every
   `torch.ops.sgl_kernel` use, per file, and in particular on the modules of the path we run;
3. `plugin_graphs` phase (own process, no SGLang): the plugin's linear and MoE computations on the GPU, eager and
   captured in a CUDA graph (a host synchronisation breaks the capture);
4. `imports` phase (own process, no sgl_kernel of any kind): which GPU-path modules import, and the import chain of
   each failure; then one of SGLang's JIT kernels (the KV-cache store, nvcc through tvm-ffi) is built and timed;
5. engine phases (own process each, the recording sgl_kernel stand-in of tests/rollout/sglang/gpu_stand_ins first on
   PYTHONPATH, SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1), by default in this order (--phases): `eager`
   (SGLANG_FORCE_FUSED_OP_BACKEND=torch: SGLang's fused ops take their PyTorch bodies; CUDA graphs off); if its
   engine started, `graphs` (the same with decode CUDA graphs); if the plugin's model did not generate with graphs,
   `graphs_bf16` (the same on a BF16 checkpoint, SGLang's own layers: is it the plugin or SGLang that stops the
   graphs?); `sglang_ops` (graphs on, SGLang's own choice of op backends: JIT kernels compiled with nvcc, or
   sgl_kernel, which the stand-in records); if eager started, `deterministic` (graphs + enable_deterministic_inference, the backend's GPU default). Each phase's JSON carries
   the sgl_kernel names its processes took and called.
A phase gets at most its own limit and what is left of --budget; phases that no longer fit are recorded as skipped.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tools" / "sglang_gpu_probe_engine.py"
GPU_STAND_IN = ROOT / "tests" / "rollout" / "sglang" / "gpu_stand_ins"
CPU_STUBS = ROOT / "tests" / "rollout" / "sglang" / "stubs"
PACKAGES = ["torch", "triton", "numpy", "transformers", "huggingface-hub", "tokenizers", "safetensors", "torchvision",
            "sglang", "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer", "megatron-core", "pydantic",
            "fastapi", "xgrammar", "apache-tvm-ffi", "compressed-tensors", "cuda-python", "cuda-bindings",
            "nvidia-ml-py", "pyzmq", "uvloop", "einops", "sentencepiece", "openai", "ipython", "pytest", "minite"]
# The files of the path we run (a Qwen3-MoE with minite_nvfp4, triton attention, CUDA graphs), for the scan's summary.
PATH_FILES = ["srt/layers/layernorm.py", "srt/layers/activation.py", "srt/layers/rotary_embedding",
              "srt/layers/sampler.py", "srt/layers/logits_processor.py", "srt/layers/moe/topk.py",
              "srt/layers/moe/fused_moe_triton", "srt/layers/attention/triton_backend.py",
              "srt/layers/attention/attention_registry.py", "srt/layers/linear.py",
              "srt/layers/vocab_parallel_embedding.py", "srt/layers/quantization/__init__.py",
              "srt/layers/quantization/modelopt_quant.py", "srt/models/qwen3_moe.py", "srt/mem_cache/memory_pool.py",
              "srt/model_executor", "srt/managers/scheduler.py", "srt/managers/tp_worker.py",
              "srt/entrypoints/engine.py", "srt/distributed", "srt/utils",
              "kernels/ops/attention/decode_attention.py", "kernels/ops/attention/extend_attention.py"]


class Probe:
    def __init__(self, out: Path, budget: float):
        self.out, self.deadline, self.t0 = out, time.monotonic() + budget, time.monotonic()
        self.data = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": []}
        self.log = open(out / "probe.log", "a")
        self.write()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "probe.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "probe.json")

    def step(self, name: str, fn):
        row = {"step": name, "ok": False}
        t0 = time.perf_counter()
        try:
            row["value"] = fn()
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - a probe records every failure and goes on
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["steps"].append(row)
        self.write()
        return row


# ---- 1. environment ------------------------------------------------------------------------------------------
def _run(cmd: list, timeout: float = 20) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()[-2000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"


def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
            versions[name] = f"{dist.version} ({dist.locate_file('')})"
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    everything = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                         if d.metadata["Name"]}, key=str.lower)
    env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "versions": versions, "all_distributions": everything, "nvidia_smi": _run(["nvidia-smi", "-L"]),
           "nvcc": _run(["nvcc", "--version"]).splitlines()[-1:] or None}
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["capability"] = torch.cuda.get_device_capability(0)
    except Exception as e:  # noqa: BLE001 - a broken torch is a finding, not a crash
        env["torch_error"] = f"{type(e).__name__}: {e}"
    return env


# ---- 2. static scan ------------------------------------------------------------------------------------------
def _sgl_kernel_refs(tree: ast.AST) -> dict:
    """{"module": [...], "function": [...]}: sgl_kernel names imported or used, at module level or inside a def."""
    found = {"module": set(), "function": set()}

    def visit(node, in_def):
        for child in ast.iter_child_nodes(node):
            inner = in_def or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            where = "function" if inner else "module"
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "sgl_kernel":
                sub = child.module[len("sgl_kernel"):].lstrip(".")
                found[where].update(f"{sub + '.' if sub else ''}{a.name}" for a in child.names)
            elif isinstance(child, ast.Import):
                found[where].update(a.name for a in child.names if a.name.split(".")[0] == "sgl_kernel")
            elif (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Attribute)
                  and child.value.attr == "sgl_kernel" and isinstance(child.value.value, ast.Attribute)
                  and child.value.value.attr == "ops"):
                found[where].add(f"torch.ops.sgl_kernel.{child.attr}")
            visit(child, inner)

    visit(tree, False)
    return {k: sorted(v) for k, v in found.items() if v}


def static_scan() -> dict:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed")
    pkg = Path(list(spec.submodule_search_locations)[0])
    per_file = {}
    for sub in ("srt", "kernels"):
        for py in sorted((pkg / sub).rglob("*.py")):
            rel = str(py.relative_to(pkg))
            if "/test" in rel:
                continue
            text = py.read_text(errors="replace")
            if "sgl_kernel" not in text:  # parsing only the files that name it keeps the scan to seconds
                continue
            try:
                refs = _sgl_kernel_refs(ast.parse(text))
            except SyntaxError as e:
                refs = {"syntax_error": str(e)}
            if refs:
                per_file[rel] = refs
    on_path = {f: r for f, r in per_file.items() if any(f.startswith(p) for p in PATH_FILES)}
    module_level = sorted({n for r in on_path.values() for n in r.get("module", [])})
    return {"package": str(pkg), "files_referencing": len(per_file),
            "files_with_module_level_import": sorted(f for f, r in per_file.items() if "module" in r),
            "path_files": on_path, "path_module_level_names": module_level,
            "path_function_level_names": sorted({n for r in on_path.values() for n in r.get("function", [])})}


# ---- 3./4. phases in their own processes ---------------------------------------------------------------------
def _stand_in_summary(path: Path) -> dict:
    taken, called = set(), set()
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            (called if row["event"] == "call" else taken).add(row["name"])
    return {"taken": sorted(taken), "called": sorted(called)}


def _run_group(cmd: list, env: dict, timeout: float):
    """(return code or "timeout", output). The worker leads a process group of its own; SGLang's scheduler and
    detokenizer processes are in it, so whatever is left of the group is killed afterwards and holds no GPU memory
    into the next phase."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = "timeout"
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return rc, out or ""


def run_phase(probe: Probe, name: str, args: list, env_extra: dict, limit: float, stand_ins: list) -> dict:
    budget = min(limit, probe.left() - 5)
    if budget < 20:
        row = {"phase": name, "skipped": f"out of budget ({probe.left():.0f} s left)"}
        probe.data.setdefault("phases", {})[name] = row
        probe.write()
        return row
    out_json = probe.out / f"phase_{name}.json"
    log_path = Path(f"/tmp/sglang_gpu_probe_{name}.stand_in.jsonl")
    log_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MINITE_SGL_KERNEL_STANDIN_LOG": str(log_path), **env_extra}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths += [] if str(ROOT) in paths else [str(ROOT)]  # last: an installed minite layout comes first
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in stand_ins] + paths)
    cmd = [sys.executable, str(WORKER), *args, "--json", str(out_json), "--start-timeout", str(int(budget * 0.8))]
    t0 = time.perf_counter()
    rc, text = _run_group(cmd, env, budget)
    row = json.loads(out_json.read_text()) if out_json.exists() else {"steps": []}
    out_json.unlink(missing_ok=True)  # folded into probe.json (few files may come back from a GPU machine)
    row.update(phase=name, rc=rc, seconds=round(time.perf_counter() - t0, 1), env_extra=env_extra,
               stand_ins=[str(p) for p in stand_ins], sgl_kernel_stand_in=_stand_in_summary(log_path),
               output_tail=text[-6000:])
    probe.log.write(f"\n===== phase {name} (rc {rc}) =====\n{text[-400_000:]}\n")
    probe.log.flush()
    probe.data.setdefault("phases", {})[name] = row
    probe.write()
    return row


def _ran(row: dict, step: str) -> bool:
    return any(s["step"] == step and s["ok"] for s in row.get("steps", []))


def run_engine_phases(probe: Probe, gpu: bool, cpu_engine: bool, phases: list) -> None:
    if not gpu and not cpu_engine:
        probe.data.setdefault("phases", {})["engine"] = {"skipped": "no GPU (pass --cpu-engine for a CPU dry run)"}
        probe.write()
        return
    skip = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
    if not gpu:  # the dry run: SGLang's CPU engine, the recording sgl_kernel first, the CPU torchvision stub
        run_phase(probe, "eager", ["engine"], skip, 240, [GPU_STAND_IN, CPU_STUBS])
        return
    torch_ops = {**skip, "SGLANG_FORCE_FUSED_OP_BACKEND": "torch"}
    spec = {"eager": (["engine"], torch_ops, 110), "graphs": (["engine", "--graphs"], torch_ops, 200),
            "graphs_bf16": (["engine", "--graphs", "--bf16"], torch_ops, 90),
            "sglang_ops": (["engine", "--graphs"], skip, 100),
            "deterministic": (["engine", "--graphs", "--deterministic"], torch_ops, 90)}
    done = probe.data.setdefault("phases", {})
    for name in [p for p in phases if p in spec]:
        if name in ("graphs", "deterministic") and "eager" in done and not _ran(done["eager"], "engine_start"):
            done[name] = {"skipped": "the eager phase's engine did not start"}
            continue
        if name == "graphs_bf16" and "graphs" in done and _ran(done["graphs"], "generate_greedy_logprobs"):
            done[name] = {"skipped": "not needed: the plugin's model generated with CUDA graphs"}
            continue
        args, env_extra, limit = spec[name]
        run_phase(probe, name, args, env_extra, limit, [GPU_STAND_IN])


# ---- report --------------------------------------------------------------------------------------------------
def _first_line(row: dict) -> str:
    if row.get("error"):
        return " ".join(row["error"].split())[:110]
    value = row.get("value")
    if row["step"] == "environment":
        return f"python {value['python']}, GPUs {value.get('gpus')}"
    if row["step"] == "static_scan_sgl_kernel":
        return (f"{value['files_referencing']} files name sgl_kernel; module-level on our path: "
                f"{', '.join(value['path_module_level_names'])}")[:400]
    return json.dumps(value, default=str)[:110] if "value" in row else ""


def table(data: dict) -> str:
    lines = [f"{'phase/step':44} {'ok':4} {'s':>7}  note"]
    for s in data["steps"]:
        lines.append(f"{s['step']:44} {'yes' if s['ok'] else 'NO':4} {s['seconds']:7.1f}  {_first_line(s)}")
    for name, ph in data.get("phases", {}).items():
        if "skipped" in ph:
            lines.append(f"{name:44} {'-':4} {'':>7}  skipped: {ph['skipped']}")
            continue
        bad = [m for m, r in ph.get("imports", {}).items() if not r["ok"]]
        note = f"imports failed: {len(bad)}/{len(ph['imports'])} {bad[:3]}" if ph.get("imports") else ""
        lines.append(f"{name + ' (rc ' + str(ph.get('rc')) + ')':44} {'':4} {ph.get('seconds', 0):7.1f}  {note}")
        for m in bad[:4]:
            lines.append(f"  {m[-42:]:42} {'NO':4} {'':>7}  {' '.join(ph['imports'][m]['error'].split())[:110]}")
        for s in ph.get("steps", []):
            lines.append(f"  {s['step']:42} {'yes' if s['ok'] else 'NO':4} {s['seconds']:7.1f}  {_first_line(s)}")
        sk = ph.get("sgl_kernel_stand_in", {})
        if sk.get("taken") or sk.get("called"):
            lines.append(f"  sgl_kernel stand-in: took {sk['taken'][:12]}, called {sk['called']}")
        if not ph.get("finished"):  # killed or crashed mid-step (SGLang kills its process tree when a child dies)
            tail = [ln.strip() for ln in ph.get("output_tail", "").splitlines() if ln.strip()][-4:]
            lines += [f"  unfinished; output ends: {ln[:150]}" for ln in tail]
        for flag in ("greedy_reproducible", "sampled_reproducible", "update_changed_output", "round_trip_bitwise"):
            if flag in ph:
                lines.append(f"  {flag}: {ph[flag]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for probe.json and probe.log")
    p.add_argument("--budget", type=float, default=200, help="seconds for the whole probe (phases are cut to fit)")
    p.add_argument("--cpu-engine", action="store_true", help="without a GPU: run the eager phase on the CPU engine")
    p.add_argument("--phases", default="eager,graphs,graphs_bf16,sglang_ops,deterministic",
                   help="GPU engine phases to run, in this order (module docstring)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    probe = Probe(out, a.budget)
    env = probe.step("environment", environment)
    gpu = bool(env["ok"] and env["value"].get("cuda_available"))
    if env["ok"]:
        v = env["value"]
        print(f"python {v['python']}; GPUs {v.get('gpus')}; torch CUDA {v.get('torch_cuda')}; nvcc {v.get('nvcc')}")
        print("versions: " + ", ".join(f"{k} {(x or 'absent').split(' (')[0]}" for k, x in v["versions"].items()))
    else:
        print("environment step failed:", env["error"])
    if not gpu:
        print("no GPU: engine phases are skipped unless --cpu-engine; import checks and the scan still run")
    probe.step("static_scan_sgl_kernel", static_scan)
    run_phase(probe, "plugin_graphs", ["plugin_graphs"], {}, 80, [])
    run_phase(probe, "imports", ["imports"], {}, 120, [])
    run_engine_phases(probe, gpu, a.cpu_engine, a.phases.split(","))
    probe.data["finished"] = True
    probe.write()
    report = table(probe.data)
    (out / "probe_table.txt").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
