"""Census of the device operations of one embedded-engine decode step, counted on the CPU (issue 16: strict mode's
launch count).

Every aten op that computes (views, reshapes and other metadata-only ops left out) is counted once, with the innermost
function of its Python stack in minite/ or megatron_patches/ (the op family a fused kernel would replace), per decode
step: the difference of generate calls of 4 and 2 new tokens, halved (prefill excluded), as tools/bench/sync_census.py
does. On a GPU each counted op is roughly one kernel launch (Triton kernel launches, counted as `triton:<kernel>`, come
from the kernel path only: `--nvfp4-backend triton` with TRITON_INTERPRET=1, as on a GPU). The shapes are tiny, so the numbers are
launch counts, not times; per layer they scale to the full model (the step has a per-layer part and a fixed part).

    python tools/bench/op_census.py [--precisions bf16,nvfp4] [--modes default,strict] [--layers 2] [--top 15]
    TRITON_INTERPRET=1 python tools/bench/op_census.py --precisions nvfp4 --nvfp4-backend triton   (kernel path)
    TRITON_INTERPRET=1 python tools/bench/op_census.py --precisions nvfp4 --modes strict --nvfp4-backend triton \
        --fused-strict                                                  (strict mode with its fused kernels, as on a GPU)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

METADATA = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "expand_as", "slice",
            "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "lift_fresh", "unbind", "split",
            "split_with_sizes", "chunk", "narrow", "view_as", "unflatten", "flatten", "_reshape_alias", "movedim",
            "diagonal", "real", "imag", "view_as_real", "view_as_complex", "numpy_T", "contiguous", "is_same_size",
            "_to_copy_noop", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "size",
            "stride", "dim", "is_contiguous", "sym_size", "sym_stride", "sym_numel", "_local_scalar_dense"}
OURS = ("/minite/", "/megatron_patches/", "/kernels/")


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-3]):
        if any(p in fr.filename for p in OURS) and "/tools/" not in fr.filename:
            path = fr.filename.split("/minite/")[-1] if "/minite/" in fr.filename else fr.filename.rsplit("/", 2)[-2:]
            name = path if isinstance(path, str) else "/".join(path)
            return f"{name.replace('.py', '')}.{fr.name}"
    return "(upstream)"


class OpCensus(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in METADATA:
            self.counts[(name, _site())] += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> collections.Counter:
    """Aten ops, and Triton kernel launches where the kernels run in the interpreter (each one launch on a GPU; the
    interpreter's own tensor work inside a kernel is not counted)."""
    counts: collections.Counter = collections.Counter()
    interp = None
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction
        interp, run = InterpretedFunction, InterpretedFunction.run

        def counted(self, *args, **kwargs):
            counts[(f"triton:{getattr(self.fn, '__name__', 'kernel')}", _site())] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return run(self, *args, **kwargs)
        InterpretedFunction.run = counted
    try:
        with OpCensus(counts):
            fn()
    finally:
        if interp is not None:
            interp.run = run
    return counts


def per_step(engine, batch: int, prompt_len: int = 8) -> dict:
    from bench_rollout import TINY
    from minite.rollout import SamplingParams
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, TINY["vocab_size"], (batch, prompt_len), generator=g).tolist()
    run = lambda n: engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n, seed=0))  # noqa: E731
    run(2)  # warm-up: quantised-weight caches, lazy imports
    c2, c4 = count(lambda: run(2)), count(lambda: run(4))
    return {k: (c4[k] - c2.get(k, 0)) / 2 for k in set(c4) | set(c2) if c4[k] != c2.get(k, 0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--modes", default="default,strict")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top", type=int, default=15, help="sites listed per row")
    p.add_argument("--nvfp4-backend", default="auto",
                   help="'triton' with TRITON_INTERPRET=1: NVFP4 on the kernels' path, as on a GPU (slow)")
    p.add_argument("--fused-strict", action="store_true",
                   help="with TRITON_INTERPRET=1: strict mode's ops take minite.strict.fused's kernels as on a GPU "
                        "(routed as if the tensors were CUDA ones; each kernel counted as one launch)")
    a = p.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if a.fused_strict:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--fused-strict needs TRITON_INTERPRET=1 (the kernels run in Triton's interpreter on the CPU)")
        from minite.strict import fused
        fused._gpu = lambda x: True  # route as on a GPU; the interpreter runs the kernels on the CPU tensors
    from sync_census import engine_for
    rows = {}
    for precision in a.precisions.split(","):
        for mode in a.modes.split(","):
            step = per_step(engine_for(precision, mode == "strict", a.layers, a.nvfp4_backend), a.batch)
            one = per_step(engine_for(precision, mode == "strict", a.layers + 1, a.nvfp4_backend), a.batch)
            total, total1 = sum(step.values()), sum(one.values())
            per_layer = total1 - total
            rows[(precision, mode)] = total
            print(f"== {precision} {mode}: {total:g} ops per decode step with {a.layers} layers "
                  f"({per_layer:g} per layer, {total - a.layers * per_layer:g} outside the layers; batch {a.batch})")
            sites = collections.Counter()
            for (op, site), n in step.items():
                sites[site] += n
            for site, n in sites.most_common(a.top):
                ops = collections.Counter({op: m for (op, s), m in step.items() if s == site})
                print(f"  {n:7g}  {site}: " + ", ".join(f"{op} {m:g}" for op, m in ops.most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
