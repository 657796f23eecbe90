"""A decode step's attention by SDPA backend (issue 16): one query per sequence over the KV cache, as
megatron_patches.qwen3_moe.sdpa_attention calls torch's scaled_dot_product_attention for it (the np / ng query heads
of a KV group as that group's queries, the cache read in place through a permuted view), timed for every backend
torch will run at each shape, in CUDA-graph replays; each backend's output compared bit for bit with the one torch
picks by itself ("default").

    python tools/bench/bench_decode_attention.py --out /tmp/decode-attention.json [--batches 8,64,256]
        [--contexts 72,1064,2088]

The rollout slice's attention: 32 query heads in 4 groups of 128 channels, bf16; a context is the number of cached
keys the step reads (prompt + tokens so far). The JSON: device, date, commit, command, rows (batch, context, backend,
us, bitwise_vs_default, max_abs_diff_vs_default, error), the bytes of K and V per call (bytes_kv) and how many input
sets the timed graph cycles through (input_sets, `run`).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import save, stamp  # noqa: E402
from timing import bench_graph  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def decode_inputs(batch: int, context: int, groups: int = 4, rep: int = 8, hn: int = 128, seed: int = 0,
                  device: str = "cuda"):
    """q [b, groups, rep, hn] and k/v [b, groups, context, hn] views of a [context, b, groups, hn] cache, as
    sdpa_attention hands them to SDPA in a decode step (tests/rollout/test_decode_kernels_tool.py)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, groups, rep, hn, device=device, generator=g).bfloat16()
    k, v = (torch.randn(context, batch, groups, hn, device=device, generator=g).bfloat16().permute(1, 2, 0, 3)
            for _ in range(2))
    return q, k, v


def run(batch: int, context: int) -> list[dict]:
    """Every backend at one shape: a graph of one call on each of `sets` input sets, so that K and V come from HBM
    rather than L2 where the sets add up to more than it (from ~150 MB: not at the smallest shapes, whose times
    include L2 reads)."""
    q, k, v = decode_inputs(batch, context)
    bytes_kv = 2 * k.numel() * k.element_size()
    sets = [(q, k, v)] + [decode_inputs(batch, context, seed=i)
                          for i in range(1, min(16, max(2, -(-150_000_000 // bytes_kv))))]
    scale = q.shape[-1] ** -0.5
    rows, ref = [], None
    for name, backend in BACKENDS.items():
        row = {"batch": batch, "context": context, "backend": name, "bytes_kv": bytes_kv, "input_sets": len(sets)}

        def ctx(backend=backend):  # a fresh context per use (sdpa_kernel's is single-use)
            return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()

        def step():
            with ctx():
                for qs, ks, vs in sets:
                    F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        try:
            with ctx():
                out = F.scaled_dot_product_attention(q, k, v, scale=scale)
            row["us"] = round(bench_graph(step, len(sets)) * 1e3, 2)
        except RuntimeError as e:  # a backend that refuses these inputs
            row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            continue
        if name == "default":
            ref = out
        row["bitwise_vs_default"] = None if ref is None else bool(torch.equal(out, ref))
        row["max_abs_diff_vs_default"] = None if ref is None else float((out.float() - ref.float()).abs().max())
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="8,64,256")
    p.add_argument("--contexts", default="72,1064,2088")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention: needs a CUDA GPU (it times torch's SDPA backends there)")
    rows = []
    for b in map(int, a.batches.split(",")):
        for c in map(int, a.contexts.split(",")):
            for r in run(b, c):
                rows.append(r)
                t = f"{r['us']:8.2f} us  {r['bytes_kv'] / r['us'] / 1e6:5.2f} TB/s  bitwise {r['bitwise_vs_default']}" \
                    if "us" in r else f"error: {r['error']}"
                print(f"batch {b:4d} context {c:5d} {r['backend']:9s} {t}", flush=True)
    save({"device": torch.cuda.get_device_name(), **stamp(), "torch": torch.__version__, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
