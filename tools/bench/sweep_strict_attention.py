"""Strict mode's fused attention (minite/strict/fused_attention.py) at decode shapes, over its launch constants.

    python tools/bench/sweep_strict_attention.py --out /tmp/sweep.json [--key-blocks 16,32] [--warps 1,2,4,8]
        [--chunk-blocks 4,8] [--heads 1,2,4,8] [--one-launch-blocks 0,8] [--min-programs 256,2048]
        [--shapes 64x72,64x1064]

Two trees side by side (the shipped configuration of each at AB_SHAPES, outputs compared bit for bit):

    MINITE_TREE=/tmp/old python tools/bench/sweep_strict_attention.py --save /tmp/old.pt
    python tools/bench/sweep_strict_attention.py --save /tmp/new.pt
    python tools/bench/sweep_strict_attention.py --compare /tmp/old.pt /tmp/new.pt --out /tmp/ab.json

(MINITE_TREE: the checkout whose `minite` is imported; this file's own by default.)

For bf16 q [1, batch, 32, 128] and k/v [keys, batch, 4, 128] (the rollout slice's heads at one decode step), each
combination of the swept constants (KNOBS: ATTENTION_KEY_BLOCK, _WARPS and _CHUNK_BLOCKS, by default 16,32 / 1,2,4,8 /
4,8; _HEADS_PER_PROGRAM, _ONE_LAUNCH_BLOCKS and _MIN_PROGRAMS, by default their shipped value) is timed by CUDA-graph
replays (triton.testing.do_bench_cudagraph, rep=60) and its output compared bit for bit with the shipped
configuration's. None of them changes a bit by construction (the pair tree over the padded keys is the tree over aligned
blocks of any power of two, then over the block sums; heads are independent); the comparison proves it on the device.
CUDA only. JSON with device, date, commit and command; a row holds every constant's value and what ran under them
(`effective`: heads a program, key blocks a chunk after halving, chunks, kernel).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.environ.get("MINITE_TREE") or
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minite.strict import fused_attention as FA  # noqa: E402
from provenance import commit, save, stamp  # noqa: E402

SHAPES = ((256, 72), (64, 72), (8, 56), (64, 1064), (8, 1064), (1, 1064), (64, 2088))  # (batch, keys)
AB_SHAPES = ((1, 256, 72), (1, 256, 56), (1, 256, 40), (1, 64, 72), (1, 64, 56), (1, 8, 56), (1, 1, 40), (1, 64, 200),
             (32, 16, 32), (1, 64, 1064), (1, 8, 1064), (1, 1, 1064), (1, 256, 1064),
             (1, 64, 2088))  # (queries, batch, keys): decode steps and a prefill


def _inputs(queries, batch, keys, g):
    q = torch.randn(queries, batch, 32, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(keys, batch, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    v[:, 0, 0, 0] = -0.0  # every product of this channel is -0 (p >= 0): the padding must add +0
    return q, k, v


def save_outputs(path: str) -> None:
    """The shipped configuration at AB_SHAPES: each output and its time (CUDA-graph replays, rep=100) into `path`."""
    from triton.testing import do_bench_cudagraph

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for queries, batch, keys in AB_SHAPES:
        q, k, v = _inputs(queries, batch, keys, g)
        out = FA.attention(q, k, v, 0.088)
        us = 1000 * do_bench_cudagraph(lambda: FA.attention(q, k, v, 0.088), rep=100)
        rows.append(dict(queries=queries, batch=batch, keys=keys, us=us, out=out.cpu()))
        print(f"{commit()} queries {queries:2d} batch {batch:3d} keys {keys:3d}: {us:7.1f} us", flush=True)
    torch.save(dict(commit=commit(), device=torch.cuda.get_device_name(), rows=rows), path)


def compare(old_path: str, new_path: str) -> dict:
    old, new = (torch.load(p) for p in (old_path, new_path))
    if old["device"] != new["device"]:
        raise SystemExit(f"sweep_strict_attention: {old['device']} and {new['device']}: not one device")
    rows = []
    for a, b in zip(old["rows"], new["rows"]):
        same = bool(torch.equal(a["out"].view(torch.int32), b["out"].view(torch.int32)))
        rows.append(dict(queries=a["queries"], batch=a["batch"], keys=a["keys"], old_us=a["us"], new_us=b["us"],
                         ratio=b["us"] / a["us"], bitwise=same, old_commit=old["commit"], new_commit=new["commit"]))
        print(f"queries {a['queries']:2d} batch {a['batch']:3d} keys {a['keys']:3d}: {old['commit']} {a['us']:7.1f} us,"
              f" {new['commit']} {b['us']:7.1f} us (x{b['us'] / a['us']:.2f})  bitwise={same}")
    return dict(device="1x " + new["device"], rows=rows)


KNOBS = (("key_block", "ATTENTION_KEY_BLOCK", "--key-blocks", "16,32"),
         ("warps", "ATTENTION_WARPS", "--warps", "1,2,4,8"),
         ("chunk_blocks", "ATTENTION_CHUNK_BLOCKS", "--chunk-blocks", "4,8"),
         ("heads", "ATTENTION_HEADS_PER_PROGRAM", "--heads", None),
         ("one_launch_blocks", "ATTENTION_ONE_LAUNCH_BLOCKS", "--one-launch-blocks", None),
         ("min_programs", "ATTENTION_MIN_PROGRAMS", "--min-programs", None))
"""(row key, fused_attention constant, flag, the flag's default: None keeps the shipped value)."""


def effective(batch: int, keys: int) -> dict:
    """What `FA.attention` runs for q [1, batch, 32, 128] over k [keys, batch, 4, 128] under the constants as set now
    (`FA.launch_plan`): the heads a split program takes, the key blocks a chunk after `chunk_blocks` halved them, the
    chunks, the kernel."""
    plan = FA.launch_plan(1, batch, 32, 4, keys)
    return dict(heads_run=plan.heads, chunk_blocks_run=plan.chunk_blocks, chunks_run=plan.chunks,
                kernel="per-head, one launch" if plan.chunks == 1 else "split, four launches")


def sweep(values: dict, shapes=SHAPES) -> list[dict]:
    """Every combination of values {row key: (values...)} of KNOBS, at shapes ((batch, keys), ...)."""
    import itertools

    from triton.testing import do_bench_cudagraph

    names = {key: const for key, const, _, _ in KNOBS}
    shipped = {key: getattr(FA, const) for key, const in names.items()}
    grid = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    try:
        for batch, keys in shapes:
            q, k, v = _inputs(1, batch, keys, g)
            for key, x in shipped.items():
                setattr(FA, names[key], x)
            ref = FA.attention(q, k, v, 0.088)
            for point in grid:
                for key, x in point.items():
                    setattr(FA, names[key], x)
                same = bool(torch.equal(FA.attention(q, k, v, 0.088).view(torch.int32), ref.view(torch.int32)))
                us = 1000 * do_bench_cudagraph(lambda: FA.attention(q, k, v, 0.088), rep=60)
                rows.append(dict(batch=batch, keys=keys, **{key: getattr(FA, const) for key, const in names.items()},
                                 **effective(batch, keys), us=us, bitwise=same))
                knobs = " ".join(f"{key} {x}" for key, x in point.items())
                print(f"b {batch:3d} keys {keys:4d} {knobs}: {us:7.1f} us  bitwise={same}", flush=True)
    finally:
        for key, x in shipped.items():
            setattr(FA, names[key], x)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON to write (the sweep, or --compare's rows)")
    for _, const, flag, default in KNOBS:
        p.add_argument(flag, default=default, help=f"values of {const}, comma-separated"
                       + ("" if default else " (default: the shipped one)"))
    p.add_argument("--shapes", default=",".join(f"{b}x{k}" for b, k in SHAPES), help="BATCHxKEYS,...")
    p.add_argument("--save", metavar="PT", help="time the shipped configuration at AB_SHAPES, save outputs and times")
    p.add_argument("--compare", nargs=2, metavar=("OLD_PT", "NEW_PT"), help="two --save files -> --out")
    a = p.parse_args(argv)
    if a.compare:
        doc = compare(*a.compare)
    else:
        if not torch.cuda.is_available():
            print("sweep_strict_attention: needs CUDA", file=sys.stderr)
            return 2
        if a.save:
            save_outputs(a.save)
            return 0
        given = {key: getattr(a, flag[2:].replace("-", "_")) for key, _, flag, _ in KNOBS}
        values = {key: tuple(int(x) for x in v.split(",")) for key, v in given.items() if v}
        shapes = tuple(tuple(int(x) for x in shape.split("x")) for shape in a.shapes.split(","))
        doc = {"device": "1x " + torch.cuda.get_device_name(), "rows": sweep(values, shapes)}
    if not a.out:
        print("sweep_strict_attention: --out is needed", file=sys.stderr)
        return 2
    save({"device": doc["device"], **stamp(), "torch": torch.__version__, "rows": doc["rows"]}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
