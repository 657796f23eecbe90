"""Peak memory of `minite convert` on a random Qwen3-MoE checkpoint larger than a hard memory limit.

    python tools/convert_memory.py --model-mib 2048 --limit-mib 256 [--tp 2 --ep 4] [--dir /tmp/x] [--json]

1. Writes a random BF16 Qwen3-MoE HF checkpoint of about --model-mib (hidden 512, 64 experts, as many layers as
   the size needs) in 256 MiB shards with an index, streaming (this script never holds the model either).
2. Runs hf-to-megatron, then megatron-to-hf, each in a fresh process that, after its imports, resets its peak-RSS
   counter (/proc/self/clear_refs), caps its address space at (current size + --limit-mib) with RLIMIT_AS, so any
   allocation past the limit fails, and reports VmHWM (peak resident set) minus its resident set before converting.
   The child runs one intra-op thread with MALLOC_ARENA_MAX=2: glibc reserves 64 MiB of address space per thread
   arena, which counts against RLIMIT_AS though it is never touched.
3. Checks the round trip bitwise (every safetensors file identical) and prints one JSON line per --json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from minite.convert.hf_megatron import hf_shapes, read_shape  # noqa: E402
from minite.convert.safetensors_stream import StreamWriter, view2d  # noqa: E402

MIB = 1024 * 1024
BASE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
            num_experts=64, num_experts_per_tok=8, vocab_size=8192, tie_word_embeddings=False,
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rope_theta=1e6, rms_norm_eps=1e-6,
            max_position_embeddings=4096, norm_topk_prob=True, torch_dtype="bfloat16")

CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from minite.convert.hf_megatron import hf_to_megatron, megatron_to_hf
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
direction, src, dst, limit, tp, ep, pp = sys.argv[1:8]
torch.empty(1 << 20).add_(1)  # touch the allocator and thread pool before the limit
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
rss0, vm0 = status("VmRSS"), status("VmSize")
resource.setrlimit(resource.RLIMIT_AS, (vm0 + int(limit), vm0 + int(limit)))
if direction == "hf_to_megatron":
    hf_to_megatron(src, dst, tp=int(tp), ep=int(ep), pp=int(pp), progress=False)
else:
    megatron_to_hf(src, dst, progress=False)
print(json.dumps({"rss_before_bytes": rss0, "peak_rss_bytes": status("VmHWM"),
                  "peak_rss_growth_bytes": status("VmHWM") - rss0, "address_space_limit_bytes": vm0 + int(limit)}))
"""


def write_random_hf(d: Path, model_mib: int, shard_mib: int = 256, seed: int = 0) -> int:
    """A random checkpoint of >= model_mib; returns its tensor bytes."""
    per_layer = read_shape({**BASE, "num_hidden_layers": 1, "moe_intermediate_size": BASE["moe_intermediate_size"]})
    one = sum(math.prod(s) for n, s in hf_shapes(per_layer).items() if n.startswith("model.layers.")) * 2
    rest = sum(math.prod(s) for n, s in hf_shapes(per_layer).items() if not n.startswith("model.layers.")) * 2
    cfg = {**BASE, "num_hidden_layers": max(1, math.ceil((model_mib * MIB - rest) / one))}
    shapes = hf_shapes(read_shape(cfg))
    shards, size = [[]], 0
    for name, shp in shapes.items():
        if shards[-1] and size + math.prod(shp) * 2 > shard_mib * MIB:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += math.prod(shp) * 2
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(8 * MIB, generator=gen).to(torch.bfloat16)  # random values; chunks are windows of it
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = StreamWriter(d / file, [(n, "BF16", shapes[n]) for n in names])
        for n in names:
            rows, cols = view2d(shapes[n])
            step = max(1, 4 * MIB // cols)
            for a in range(0, rows, step):
                k = min(rows - a, step) * cols
                start = int(torch.randint(0, pool.numel() - k + 1, (1,), generator=gen))
                w.write(n, pool[start:start + k])
            weight_map[n] = file
            total += rows * cols * 2
        w.close()
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}, indent=2))
    return total


def run_child(direction: str, src: Path, dst: Path, limit: int, tp: int, ep: int, pp: int) -> dict:
    # a minimal environment: variables other programs left behind (a test suite's, an engine's) must not change the
    # child's thread or allocator set-up, which is what its address-space budget is sized for
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env = {**keep, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", CHILD, direction, str(src), str(dst), str(limit), str(tp), str(ep),
                          str(pp)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{direction} failed under the limit:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-mib", type=int, default=2048)
    ap.add_argument("--limit-mib", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        total = write_random_hf(tmp / "hf", a.model_mib)
        limit = a.limit_mib * MIB
        res = {"model_bytes": total, "limit_bytes": limit, "tp": a.tp, "ep": a.ep, "pp": a.pp,
               "hf_to_megatron": run_child("hf_to_megatron", tmp / "hf", tmp / "mg", limit, a.tp, a.ep, a.pp),
               "megatron_to_hf": run_child("megatron_to_hf", tmp / "mg", tmp / "back", limit, a.tp, a.ep, a.pp)}
        files = sorted(p.name for p in (tmp / "hf").glob("*.safetensors"))
        res["megatron_to_hf"]["bitwise"] = all(digest(tmp / "hf" / f) == digest(tmp / "back" / f) for f in files)
    if a.json:
        print(json.dumps(res))
        return
    print(f"model {total / MIB:.0f} MiB, address-space budget {a.limit_mib} MiB above the interpreter")
    for k in ("hf_to_megatron", "megatron_to_hf"):
        r = res[k]
        print(f"{k:15s} peak RSS {r['peak_rss_bytes'] / MIB:7.1f} MiB (growth while converting "
              f"{r['peak_rss_growth_bytes'] / MIB:6.1f} MiB)")
    print(f"round trip bitwise: {res['megatron_to_hf']['bitwise']}")


if __name__ == "__main__":
    main()
