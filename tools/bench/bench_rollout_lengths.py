"""Rollouts whose responses end at different lengths, as RL's do (issue 16: "a finished sequence stops costing").

    python tools/bench/bench_rollout_lengths.py --out docs/benchmarks/rollout-lengths-h200.json   (one H200)
    python tools/bench/bench_rollout_lengths.py --tiny --batch 16 --new-tokens 32 --out /tmp/lengths.json   (CPU)

The model and prompts are bench_rollout.py's (a `--layers`-layer slice of Qwen3-30B-A3B at full width, random weights,
`--batch` prompts of `--prompt-len` random tokens). A model with random weights almost never samples a given token, so
the lengths are set: response i ends with the stop token after L_i tokens, L_i drawn once (seeded) uniformly from
1..new_tokens (`--lengths uniform`) or geometrically with mean new_tokens / 4, capped (`geometric`); the engine's
`sample` is wrapped to put the stop token there (the other tokens are the engine's own samples). Each generate is
timed whole (prefill, decode steps, read-back; synchronised), median of `--repeats` after one untimed generate, for:

    never      rollout.stop_check_every = 0: every response runs to new_tokens (the loop before 2026-12-05)
    stop       stop_check_every = K: the loop ends when every response has (with CUDA graphs: no compaction, as
               before "compact_with_graphs" joined minite.strict.fused.PROVEN on 2026-12-05)
    compact    the same with the compaction under CUDA graphs (the shipped loop since then); eager off the GPU

Rows: precision, strict, batch, new_tokens, lengths, variant, stop_check_every, generate_s, tokens (the responses'
total length), tokens_per_s (tokens / generate_s), steps (decode steps run), min_step_rows (the fewest rows a step
ran), compacted_graphs (graphs captured for fewer rows than the batch).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_rollout import TINY, _sync, device_name, engine_config, write
from provenance import commit
from shapes import FULL

VARIANTS = ("never", "stop", "compact")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/benchmarks/rollout-lengths-h200.json")
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--modes", default="default,strict")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--lengths", choices=("uniform", "geometric"), default="uniform")
    p.add_argument("--check-every", type=int, default=8, help="rollout.stop_check_every of the stop/compact rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    if set(a.variants.split(",")) - set(VARIANTS):
        p.error(f"--variants takes {', '.join(VARIANTS)}")
    if a.check_every < 1:
        p.error("--check-every must be >= 1")
    return a


def draw_lengths(kind: str, batch: int, new_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(12345)
    if kind == "uniform":
        return torch.randint(1, new_tokens + 1, (batch,), generator=g).tolist()
    p = min(1.0, 4.0 / new_tokens)
    steps = torch.empty(batch).geometric_(p, generator=g)
    return [int(min(new_tokens, s)) for s in steps.tolist()]


class ForcedLengths:
    """`minite.rollout.decode.sample` wrapped: in a generate whose prompts all have prompt_len tokens, row i's token
    at response position lengths[i] - 1 is the stop token (slots mapped to rows after a compaction), and no other
    is (a sampled stop token becomes the token below it)."""

    def __init__(self, lengths: list[int], stop: int):
        from minite.rollout import decode
        self.decode, self.sample = decode, decode.sample
        self.lengths, self.stop, self.position, self.min_rows = lengths, stop, 0, len(lengths)

    def __enter__(self):
        self.decode.sample = self._sample
        return self

    def __exit__(self, *exc):
        self.decode.sample = self.sample

    def start(self) -> None:  # before each generate
        self.position, self.min_rows = 0, len(self.lengths)

    def _sample(self, logits, temperature, top_p, generator, vocab_size, rows=None, batch=0, sampler="megatron",
                lse=None):
        tokens = self.sample(logits, temperature, top_p, generator, vocab_size, rows, batch, sampler, lse)
        tokens = torch.where(tokens == self.stop, tokens - 1, tokens)  # a stop sampled on its own: not one
        lengths = torch.tensor(self.lengths, device=tokens.device)
        ends = (lengths if rows is None else lengths[rows]) == self.position + 1
        self.position += 1
        self.min_rows = min(self.min_rows, tokens.shape[0])
        return torch.where(ends, torch.full_like(tokens, self.stop), tokens)


def measure(engine, a, prompts, lengths, stop, check_every: int, compact: bool) -> dict:
    from minite.rollout import SamplingParams
    from minite.rollout.decode import COMPACT_WITH_GRAPHS
    from minite.strict import fused

    engine.decoder.stop_check_every = check_every
    params = SamplingParams(max_new_tokens=a.new_tokens, seed=0, stop_token_id=stop)
    saved = fused.PROVEN  # this row's own setting, whatever MINITE_TRY_KERNELS says
    fused.PROVEN = (fused.PROVEN | {COMPACT_WITH_GRAPHS}) if compact else (fused.PROVEN - {COMPACT_WITH_GRAPHS})
    times, out = [], None
    try:
        with ForcedLengths(lengths, stop) as forced:
            for i in range(a.repeats + 1):  # the first untimed: compiles, captures
                forced.start()
                _sync()
                t = time.perf_counter()
                out = engine.generate(prompts, params)
                _sync()
                if i:
                    times.append(time.perf_counter() - t)
                steps, min_rows = forced.position - 1, forced.min_rows  # samples after the prefill's
    finally:
        fused.PROVEN = saved
    got = [len(r.tokens) for r in out]
    if got != [min(n, a.new_tokens) for n in lengths]:  # the responses end where they were set to
        raise RuntimeError(f"response lengths {got[:8]}... differ from the set ones {lengths[:8]}...")
    sizes = {n for st in engine.decoder._shapes.values() for n, _ in st.graphs}
    generate_s = statistics.median(times)
    return {"generate_s": generate_s, "tokens": sum(got), "tokens_per_s": sum(got) / generate_s, "steps": steps,
            "min_step_rows": min_rows, "compacted_graphs": bool(sizes) and min(sizes) < len(prompts)}


def main(argv=None) -> int:
    a = parse(argv)
    from minite.megatron_patches.strict import apply_strict
    from minite.rollout.embedded import EmbeddedEngine, build_embedded

    shape = dict(TINY if a.tiny else FULL)
    a.layers = 2 if a.tiny else a.layers
    stop = shape["vocab_size"] - 1
    lengths = draw_lengths(a.lengths, a.batch, a.new_tokens)
    g = torch.Generator().manual_seed(a.batch)
    prompts = torch.randint(1, stop, (a.batch, a.prompt_len), generator=g).tolist()
    doc = {"device": device_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": commit(), "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
           "lengths": lengths, "rows": []}
    out = Path(a.out)
    for precision in a.precisions.split(","):
        model = build_embedded(engine_config(a, shape, precision)).model
        for mode in ("default", "strict"):
            if mode not in a.modes.split(","):
                continue
            if mode == "strict":
                apply_strict(model)
            engine = EmbeddedEngine(model, strict=mode == "strict", cuda_graphs=torch.cuda.is_available(),
                                    packed_weights=precision == "nvfp4")
            for variant in a.variants.split(","):
                every = 0 if variant == "never" else a.check_every
                row = {"precision": precision, "strict": mode == "strict", "batch": a.batch,
                       "new_tokens": a.new_tokens, "lengths": a.lengths, "variant": variant, "stop_check_every": every,
                       **measure(engine, a, prompts, lengths, stop, every, variant == "compact")}
                doc["rows"].append(row)
                write(out, doc)
                print(f"{precision:5s} {mode:7s} {variant:8s}: {row['generate_s'] * 1e3:9.1f} ms, {row['steps']} "
                      f"steps, {row['tokens_per_s']:,.0f} tokens/s", flush=True)
            del engine
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
