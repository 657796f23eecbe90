"""Census of the host synchronisations of one embedded-engine decode step, counted on the CPU (issue 16), of one
Learner train step (`learner_census`, issue 17) and of the RL loop's training on a batch (`rl_census`).

On the CPU nothing synchronises, so this counts the operations that would on a GPU, each with the innermost frames of
its Python stack in minite/, megatron_patches/, kernels/ and megatron/core:
- host reads of a tensor's value: `_local_scalar_dense` (item, bool, int, float), `tolist`, `numpy`, `cpu()`,
  `.to(<cpu>)` (function level, so a CPU tensor's read, which dispatches nothing, is seen too);
- ops whose output size depends on the data (nonzero, masked_select, bool-mask indexing / index_put, unique,
  bincount, histc, repeat_interleave without output_size, equal, is_nonzero);
- tensors built from host data with an explicit device (torch.tensor(..., device=...)), and `.to(device)` of a
  tensor: on a GPU a blocking host-to-device copy from pageable memory (a stream synchronisation) when the device is
  CUDA.
Which of these synchronise on a GPU depends on where the tensor lives there: sites known not to (CPU-only paths, reads
of host memory) are marked with the reason (CPU_ONLY), and the header's second number leaves them out. Not seen here:
waits that exist only in GPU code paths (Megatron's alltoall dispatcher waits for a CUDA event once per MoE layer,
in the function megatron_patches.cpu replaces on the CPU; torch's sync debug mode does not count event waits either).
The counts per decode step are the difference of generate calls of 2 and 4 new tokens (prefill excluded), halved; a
new maximum length costs the strict RoPE table one sincos per generate, which shows as 0.5.

    python tools/bench/sync_census.py [--precisions bf16,nvfp4] [--modes default,strict] [--layers 4] [--setup]
    TRITON_INTERPRET=1 python tools/bench/sync_census.py --learner 4 --nvfp4-backend triton   (a learner step)
    TRITON_INTERPRET=1 python tools/bench/sync_census.py --rl --nvfp4-backend triton   (the RL loop's micro-batch)
    TRITON_INTERPRET=1 python tools/bench/sync_census.py --precisions nvfp4 --nvfp4-backend triton   (kernel path)
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOTS = ("/minite/", "/megatron_patches/", "/kernels/", "/megatron/core/")
SELF = os.path.abspath(__file__)

aten = torch.ops.aten
DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
    aten.unique_dim.default: "unique", aten._unique2.default: "unique", aten._unique.default: "unique",
    aten.unique_consecutive.default: "unique", aten.bincount.default: "bincount", aten.histc.default: "histc",
    aten.equal.default: "equal", aten.is_nonzero.default: "is_nonzero",
    aten._local_scalar_dense.default: "item", aten.item.default: "item", aten.argwhere.default: "nonzero",
}
READS = {torch.Tensor.tolist: "tolist", torch.Tensor.item: "item", torch.Tensor.__bool__: "bool",
         torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
         torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu()"}
FACTORIES = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}


def _line(path: str, needle: str) -> str:
    """`path:line` of the one line of the repository file `path` that contains `needle` (our files' sites are found by
    their text: line numbers move with every edit, and a stale one made this census count the CPU's NaN check as a
    GPU synchronisation)."""
    file = Path(__file__).resolve().parents[2] / path
    hits = [i for i, text in enumerate(file.read_text().splitlines(), 1) if needle in text]
    if len(hits) != 1:
        raise RuntimeError(f"sync_census: {needle!r} is on {len(hits)} lines of {path}, expected one")
    return f"{path}:{hits[0]}"


NVFP4_HOST_COUNTS = _line("megatron_patches/nvfp4_layers.py",
                          "counts = [int(c) for c in (counts.tolist() if torch.is_tensor(counts) else counts)]")
CPU_ONLY = {
    # innermost frame (file:line, or a file's prefix) -> why the site does not synchronise on a GPU; the upstream
    # lines are Megatron-Core 0.16.1's, ours are found by their text
    "megatron_patches/cpu.py:": "CPU patch of the dispatcher's D2H (a GPU: non-blocking copies + 1 event wait/layer)",
    "core/transformer/moe/moe_utils.py:50": "split sizes already on the host on a GPU (after the event wait)",
    "core/transformer/moe/router.py:90": "moves a CPU weight to the device: CPU only",
    "core/models/common/embeddings/rotary_pos_embedding.py:162": "moves a CPU table to the device: CPU only",
    NVFP4_HOST_COUNTS: "host counts for the per-expert loop (CPU); on a GPU only strict BF16 reads them, once per "
                       "layer (counted there)",
    _line("minite/nvfp4/tensor.py", "mags = torch.tensor(E2M1_MAGNITUDES"): "reference GEMM (the CPU's backend; a GPU "
                                                                           "runs the Triton kernels)",
    _line("minite/nvfp4/quantize.py", "if check_finite and not bool(torch.isfinite(x).all()):"):
        "NaN/Inf check: CPU only (quantiser_checks_finite)",
    "minite/nvfp4/device_copy.py:": "a device-side cast of device counts, or a pinned non-blocking H2D copy",
    _line("kernels/nvfp4_segments.py", "cnt = counts.to(device=dev, dtype=torch.int32).contiguous()"):
        "a device-side cast of the device counts (the learner's wgrad segments)",
    _line("kernels/nvfp4_segments.py", "amax = amax.to(device=dev, dtype=torch.float32).contiguous()"):
        "a device-side cast of the caller's device amaxes",
    _line("minite/nvfp4/grouped.py", "padded(counts.to(device=x.device, dtype=torch.int32))"):
        "a device-side cast of the device counts (the learner's wgrad segments)",
    _line("kernels/nvfp4_wgrad.py", "widths = torch.stack([p.widths.to(device=device, dtype=torch.int32) for p in"):
        "a device-side cast of the segments' device widths (the wgrad flush)",
    _line("minite/nvfp4/quantize.py", "global_amax = global_amax.to(device=x.device, dtype=torch.float32)"):
        "a device-side cast of an amax on the device (the learner's amax hints)",
    _line("kernels/nvfp4_quant.py", "given = global_amax.to(device=dev, dtype=torch.float32).contiguous()"):
        "a device-side cast of an amax on the device (the learner's amax hints)",
    "minite/ops/grouped.py:": "host counts for the reference backend only (Triton reads the tensor)",
    "minite/rollout/sampling.py:": "the Gumbel sampler's reference, the CPU's path (a GPU runs its kernels)",
    "minite/ops/experts.py:": "host counts for the per-expert loop: CPU only",
}


def cpu_only(site: tuple[str, ...], precision: str = "", mode: str = "", device_counts: bool = False) -> str:
    if (device_counts and precision == "bf16" and mode == "strict" and site
            and site[0] == NVFP4_HOST_COUNTS):
        return ""  # GroupedExperts: strict BF16 loops over experts on a GPU too, after one host read of device counts
    return next((why for k, why in CPU_ONLY.items()
                 if site and (site[0].startswith(k) if k.endswith(":") else site[0] == k)), "")


def _site(depth: int = 3) -> tuple[str, ...]:
    """file:line of the innermost `depth` frames under ROOTS (paths from the package root)."""
    out, f = [], sys._getframe(2)
    while f is not None and len(out) < depth:
        fn = f.f_code.co_filename
        if fn != SELF and "torch/" not in fn.split("site-packages")[-1][:7]:
            for r in ROOTS:
                if r in fn:
                    out.append(f"{r.strip('/').split('/')[-1]}/{fn.split(r, 1)[1]}:{f.f_lineno}")
                    break
        f = f.f_back
    return tuple(out)


def _move_kind(args: tuple, kwargs: dict):
    """The kind of a `Tensor.to(*args, **kwargs)` (self left out): "to(<device type>)" where it names a device, else
    None (a dtype change alone)."""
    dev = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
    return None if dev is None else f"to({torch.device(dev).type})"


class Census(TorchFunctionMode):
    """Function-level reads and host-data factories."""

    def __init__(self, counts):
        super().__init__()
        self.counts = counts
        self.inside = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _move_kind(args[1:], kwargs) if func is torch.Tensor.to else READS.get(func)
        if kind is None and func in FACTORIES and "device" in kwargs and not torch.is_tensor(args[0] if args else None):
            kind = f"{FACTORIES[func]}(host data, device=)"
        if kind is None:
            return func(*args, **kwargs)
        self.counts[(kind, _site())] += 1
        self.inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.inside -= 1


class DispatchCensus(TorchDispatchMode):
    """Ops with data-dependent output sizes and scalar reads (those not already counted by `Census`)."""

    def __init__(self, counts, fn_mode: Census):
        super().__init__()
        self.counts = counts
        self.fn_mode = fn_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = DATA_DEPENDENT.get(func)
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
            if any(t is not None and torch.is_tensor(t) and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
                kind = f"{func.__name__.split('.')[0]}(bool mask)"
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            kind = "repeat_interleave(no output_size)"
        if func is aten.repeat_interleave.self_Tensor and kwargs.get("output_size") is None:
            kind = "repeat_interleave(no output_size)"
        if kind is not None and not self.fn_mode.inside:
            self.counts[(kind, _site())] += 1
        return func(*args, **kwargs)


def count(fn) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    fmode = Census(counts)
    with fmode, DispatchCensus(counts, fmode):
        fn()
    return counts


def engine_for(precision: str, strict: bool, layers: int, backend: str = "auto"):
    from bench_rollout import TINY, engine_config, parse
    from minite.megatron_patches.strict import apply_strict
    from minite.rollout.embedded import EmbeddedEngine, build_embedded

    a = parse(["--tiny", "--layers", str(layers)])
    engine = build_embedded(engine_config(a, TINY, precision))
    if engine.nvfp4 is not None:
        engine.nvfp4.backend = backend
    if strict:
        apply_strict(engine.model)
        engine = EmbeddedEngine(engine.model, strict=True)
    return engine


def census(engine, batch: int, prompt_len: int = 8):
    """Per-step counts {(kind, site): n} (difference of 4 and 2 new tokens, halved) and the prefill+setup counts of
    the 2-token call."""
    from bench_rollout import TINY
    from minite.rollout import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, TINY["vocab_size"], (batch, prompt_len), generator=g).tolist()
    run = lambda n: engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n, seed=0))
    run(2)  # warm-up (caches of quantised weights, lazy imports)
    c2, c4 = count(lambda: run(2)), count(lambda: run(4))
    return _half_difference(c2, c4), c2


def _half_difference(c2: dict, c4: dict) -> dict:
    """{site: n} that two more units (decode steps, micro-batches) add, halved: (c4 - c2) / 2, zeros left out."""
    per = {k: (c4.get(k, 0) - c2.get(k, 0)) / 2 for k in set(c4) | set(c2)}
    return {k: n for k, n in per.items() if n}


LEARNER_TINY = ["model.num_layers=1", "model.hidden_size=32", "model.vocab_size=48", "model.num_experts=4",
                "model.moe_router_topk=2", "model.moe_ffn_hidden_size=16", "model.head_dim=8", "rl.seed=11"]


def learner_census(precision: str, micro_batches: int = 4, backend: str = "triton") -> collections.Counter:
    """Counts {(kind, site): n} of one Learner train step of `micro_batches` micro-batches (a tiny one-layer MoE; the
    NVFP4 expert wgrads go through DeferredWgrads, two micro-batches a launch), after a warm-up step. NVFP4 on
    `backend` ('triton': the kernels' host code, under TRITON_INTERPRET=1 on the CPU)."""
    learner = _tiny_learner(precision, backend)[1]
    tokens = torch.randint(0, 48, (micro_batches, 17), generator=torch.Generator().manual_seed(1))
    return _warm_then_count(lambda: learner.train_step(tokens, lambda lp: (-lp.mean() / micro_batches, {}),
                                                       micro_batches=micro_batches))


def _tiny_learner(precision: str, backend: str, *sets: str):
    """(config, Learner) of LEARNER_TINY in `precision` with `sets`, NVFP4 on `backend`."""
    from minite.config import load_config
    from minite.learner.learner import Learner

    cfg = load_config(None, LEARNER_TINY + [f"precision.mode={precision}", *sets])
    learner = Learner(cfg)
    if learner.nvfp4 is not None:
        learner.nvfp4.backend = backend
    return cfg, learner


def _warm_then_count(fn) -> collections.Counter:
    """fn() once as a warm-up (caches of quantised weights, lazy imports, compiled kernels), then the counts of a
    second call, with the Tensor methods wrapped (`_patched_methods`: the backward too, which autograd runs without
    the caller's TorchFunctionMode)."""
    fn()
    counts: collections.Counter = collections.Counter()
    with _patched_methods(counts):
        fn()
    return counts


def rl_inputs(precision: str, micro_batches: int, backend: str = "triton"):
    """(run, batch, advantages) for `minite.rl.loop.train_on_batch`: the same tiny MoE as `learner_census` (on the
    GPU where there is one), a stand-in Run with what train_on_batch reads, and the loop's host-side batch (tokens,
    mask, the engine's log-probs, advantages) of 2 rows a micro-batch, one minibatch."""
    from types import SimpleNamespace

    from minite.rl.grpo import GRPOParams
    from minite.rl.loop import Batch

    cfg, learner = _tiny_learner(precision, backend, f"rl.micro_batches={micro_batches}", "rl.minibatches=1")
    g = torch.Generator().manual_seed(1)
    rows, width = 2 * micro_batches, 17
    mask = torch.zeros(rows, width - 1)
    mask[:, 7:] = 1
    batch = Batch(torch.randint(0, 48, (rows, width), generator=g), mask,
                  -torch.rand(rows, width - 1, generator=g) * mask, rows * width)
    run = SimpleNamespace(cfg=cfg, learner=learner, ref=None, step=0, grpo=GRPOParams(clip_eps_low=0.2,
                                                                                      clip_eps_high=0.2))
    return run, batch, torch.randn(rows, generator=g)


def rl_census(precision: str, micro_batches: int = 4, backend: str = "triton") -> collections.Counter:
    """Counts {(kind, site): n} of the RL loop's training on one batch (`minite.rl.loop.train_on_batch`: the
    learner's log-probs before the update, then one GRPO optimizer step of `micro_batches` chunks) on `rl_inputs`,
    after a warm-up call."""
    from minite.rl.loop import train_on_batch

    run, batch, advantages = rl_inputs(precision, micro_batches, backend)
    return _warm_then_count(lambda: train_on_batch(run, batch, advantages))


def rl_per_micro_batch(precision: str, backend: str = "triton") -> dict:
    """{(kind, site): n} that one more micro-batch adds to `rl_census` (4 micro-batches against 2, halved): what the
    loop, its GRPO loss and the learner do once per micro-batch rather than once per optimizer step."""
    return _half_difference(rl_census(precision, 2, backend), rl_census(precision, 4, backend))


@contextlib.contextmanager
def _patched_methods(counts: collections.Counter):
    """`Census`'s reads and device moves counted by wrapping the Tensor methods themselves for the duration (a
    TorchFunctionMode does not reach the backward, where the MoE wgrads run)."""
    saved = {}

    def wrap(name, kind):
        fn = getattr(torch.Tensor, name)
        saved[name] = fn

        def counted(self, *args, **kwargs):
            k = _move_kind(args, kwargs) if name == "to" else kind
            if k is not None:
                counts[(k, _site())] += 1
            return fn(self, *args, **kwargs)
        setattr(torch.Tensor, name, counted)

    for name, kind in [("to", None)] + [(f.__name__, k) for f, k in READS.items()]:
        wrap(name, kind)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _print_sites(what: str, unit: str, counts: dict, precision: str, frames: int) -> None:
    """The learner's and the RL loop's census, sites that synchronise on a GPU first (default mode, device counts)."""
    gpu = {k: n for k, n in counts.items() if not cpu_only(k[1], precision, "default", True)}
    print(f"== {what}: {sum(counts.values()):g} sync candidates per {unit}, {sum(gpu.values()):g} of them synchronise "
          "on a GPU")
    for (kind, site), n in sorted(counts.items(), key=lambda kv: (kv[0] not in gpu, -kv[1], kv[0])):
        why = cpu_only(site, precision, "default", True)
        print(f"  {n:6g}  {kind:34s} {' <- '.join(site[:frames])}" + (f"   [not on a GPU: {why}]" if why else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--modes", default="default,strict")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--frames", type=int, default=2, help="stack frames shown per site")
    p.add_argument("--nvfp4-backend", default="auto",
                   help="'triton' with TRITON_INTERPRET=1: the kernels' host code, as on a GPU (slow)")
    p.add_argument("--setup", action="store_true", help="also list the 2-token call's non-step sites")
    p.add_argument("--learner", type=int, default=0, metavar="MICRO_BATCHES",
                   help="instead: one Learner train step of that many micro-batches (a tiny one-layer MoE; NVFP4 on "
                        "--nvfp4-backend, 'triton' with TRITON_INTERPRET=1)")
    p.add_argument("--rl", action="store_true",
                   help="instead: what one more micro-batch adds to the RL loop's training on a batch (the learner's "
                        "log-probs, the GRPO loss over 4 against 2 micro-batches; the tiny one-layer MoE)")
    a = p.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if a.rl or a.learner:
        for precision in a.precisions.split(","):
            if a.rl:
                counts, what = rl_per_micro_batch(precision, a.nvfp4_backend), f"RL training {precision}"
                unit = "micro-batch"
            else:
                counts = learner_census(precision, a.learner, a.nvfp4_backend)
                what, unit = f"learner {precision}, {a.learner} micro-batches", "step"
            _print_sites(what, unit, counts, precision, a.frames)
        return 0
    for precision in a.precisions.split(","):
        for mode in a.modes.split(","):
            engine = engine_for(precision, mode == "strict", a.layers, a.nvfp4_backend)
            per_step, c2 = census(engine, a.batch)
            total = sum(per_step.values())
            dc = getattr(engine, "local_moe_layers", 0) > 0  # the engine's dispatcher leaves the counts on the device
            gpu = sum(n for (_, site), n in per_step.items() if not cpu_only(site, precision, mode, dc))
            print(f"== {precision} {mode}: {total:g} sync candidates per decode step, {gpu:g} of them synchronise on a "
                  f"GPU ({a.layers} layers, batch {a.batch}, backend {a.nvfp4_backend})")
            for (kind, site), n in sorted(per_step.items(),
                                          key=lambda kv: (bool(cpu_only(kv[0][1], precision, mode, dc)), -kv[1], kv[0])):
                why = cpu_only(site, precision, mode, dc)
                print(f"  {n:6g}  {kind:34s} {' <- '.join(site[:a.frames])}" + (f"   [not on a GPU: {why}]" if why else ""))
            if a.setup:
                print(f"  -- 2-token call, all sites: {sum(c2.values())}")
                for (kind, site), n in sorted(c2.items(), key=lambda kv: (-kv[1], kv[0])):
                    print(f"  {n:6g}  {kind:34s} {' <- '.join(site[:a.frames])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
