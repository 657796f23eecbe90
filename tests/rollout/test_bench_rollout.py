"""tools/bench/bench_rollout.py: the HBM floor it reports, and a CPU smoke run on a tiny model that writes the fixed
JSON keys (device, date, commit, command, rows with precision/strict/batch/prompt_len/new_tokens/
decode_tokens_per_s/step_ms/floor_ms), the plain-PyTorch reference rows, and a table `--render` prints."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "bench_rollout.py"
sys.path.insert(0, str(BENCH.parent))

import bench_rollout  # noqa: E402  (a script's module, found through its folder)

ROW_KEYS = {"precision", "strict", "batch", "prompt_len", "new_tokens", "decode_tokens_per_s", "step_ms", "floor_ms"}


def test_floor_of_the_full_width_slice():
    full = bench_rollout.FULL
    # top-8 of 128: one token touches 8 experts, 64 tokens nearly all (128 * (1 - (120/128)^64) = 125.94)
    assert bench_rollout.experts_touched(128, 8, 1) == 8.0
    assert round(bench_rollout.experts_touched(128, 8, 64), 2) == 125.94
    bf16 = bench_rollout.floor_bytes(full, 4, "bf16", 64, 56)
    nvfp4 = bench_rollout.floor_bytes(full, 4, "nvfp4", 64, 56)
    # by hand: per layer E(1 - (1 - k/E)^B) experts of 3 x 2048 x 768 weights, QKV 2048 x 5120 and O 4096 x 2048;
    # in BF16 always: the router 2048 x 128, RMSNorm weights (2 x 2048 + 2 x 128), the KV cache 2 x 4 x 128 values per
    # position (56) and sequence (64); then the lm_head 151936 x 2048, the final norm and 64 embedding rows
    weights = 4 * (128 * (1 - (120 / 128) ** 64) * 3 * 2048 * 768 + 2048 * 5120 + 4096 * 2048)
    rest = 4 * (2048 * 128 + 2 * 2048 + 2 * 128 + 2 * 4 * 128 * 56 * 64) * 2 + (151936 * 2048 + 2048 + 64 * 2048) * 2
    assert abs(bf16 - (weights * 2 + rest)) < 1  # bytes (the sums run in other orders)
    assert abs(nvfp4 - (weights * (0.5 + 1 / 256) + rest)) < 1
    # ms at 4.8 TB/s (the "about 1.3 ms" was at the measured 4.27 TB/s copy rate)
    assert (round(bf16 / bench_rollout.HBM_BYTES_PER_S * 1e3, 2), round(nvfp4 / bench_rollout.HBM_BYTES_PER_S * 1e3, 2)) \
        == (1.16, 0.39)


@pytest.mark.parametrize("name, rate", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                        ("NVIDIA H100 PCIe", 4.8e12), (None, 4.8e12)])
def test_floor_rate_is_the_cards(monkeypatch, name, rate):
    """The floor divides by the datasheet bandwidth of the card the call ran on (an H100's rows divided by the
    H200's 4.8 TB/s until 2026-12-06); a card without an entry (an H100 PCIe: 2.0 TB/s), or none, keeps the H200's
    nominal rate, which the JSON then records."""
    monkeypatch.setattr(bench_rollout.torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(bench_rollout.torch.cuda, "get_device_name", lambda i=0: name)
    assert bench_rollout.hbm_bytes_per_s() == rate


def test_the_default_loop_is_what_ships_for_each_precision():
    """`--variants ships` (the default) measures packed NVFP4 weights and BF16's graphs: a default of `graphs` for both
    once timed NVFP4 on the fp16 block-value path that no longer ships (an H100 run, 2026-12-05)."""
    assert bench_rollout.parse([]).variants == "ships"
    assert bench_rollout.loops("ships", "nvfp4") == ["packed"] and bench_rollout.loops("ships", "bf16") == ["graphs"]
    assert bench_rollout.loops("ships,graphs,eager", "bf16") == ["graphs", "eager"]
    assert bench_rollout.loops("graphs,ships", "nvfp4") == ["graphs", "packed"]
    assert bench_rollout.loops("packed", "bf16") == ["graphs"]  # no NVFP4 weights to pack: the loop it runs
    assert bench_rollout.loops("packed,graphs", "bf16") == ["graphs"]
    assert bench_rollout.loops("packed", "nvfp4") == ["packed"]
    with pytest.raises(SystemExit):  # argparse's one-line error, not a KeyError later
        bench_rollout.parse(["--precisions", "fp8"])
    row = {"precision": "nvfp4", "strict": False, "batch": 64, "prompt_len": 32, "new_tokens": 40, "step_ms": 2.0,
           "floor_ms": 0.4, "decode_tokens_per_s": 32000.0, "commit": "abc1234"}
    rows = [dict(row, variant=v, cuda_graphs_replayed=False) for v in ("packed", "eager")]
    table = bench_rollout.render({"commit": "abc1234", "device": "GPU", "date": "today", "command": "c",
                                  "hbm_bytes_per_s": 4.8e12, "rows": rows})
    assert "| packed (none captured) |" in table and "| eager |" in table  # a packed loop's graphs, like graphs'
    assert "| eager, gumbel |" in bench_rollout.render({"commit": "c", "device": "GPU", "date": "d", "command": "c",
                                                        "hbm_bytes_per_s": 4.8e12,
                                                        "rows": [dict(rows[1], sampler="gumbel")]})


def test_cpu_smoke_run_writes_the_fixed_keys(tmp_path):
    out = tmp_path / "rollout.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", MINITE_COMMIT="abc1234")
    cmd = [sys.executable, str(BENCH), "--tiny", "--batches", "1,3", "--prompt-len", "4", "--new-tokens", "12",
           "--short-tokens", "2", "--reference-iters", "3", "--variants", "eager,megatron", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "rows", "reference_rows"} <= set(doc)
    assert doc["device"].startswith("CPU") and doc["commit"] == "abc1234" and "bench_rollout.py" in doc["command"]
    assert doc["errors"] == []
    assert sorted((r["precision"], r["strict"], r["variant"], r["batch"]) for r in doc["rows"]) == [
        (p, s, v, b) for p in ("bf16", "nvfp4") for s in (False, True) for v in ("eager", "megatron") for b in (1, 3)]
    assert not any(r["cuda_graphs_replayed"] or r["graph_error"] for r in doc["rows"])  # no graphs on the CPU
    assert {r["variant"]: r.get("sampler") for r in doc["rows"]} == {"eager": "gumbel", "megatron": None}
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert (r["prompt_len"], r["new_tokens"]) == (4, 12)
        for k in ("decode_tokens_per_s", "step_ms", "floor_ms"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        step_s = (r["t_long_s"] - r["t_short_s"]) / (r["new_tokens"] - r["short_tokens"])  # the docstring's formula
        assert (r["decode_tokens_per_s"], r["step_ms"]) == (r["batch"] / step_s, step_s * 1e3)
    # counted on a GPU only (torch's CUDA sync debug mode), once per precision and mode, at the first batch
    assert sorted((r["precision"], r["strict"], r["variant"]) for r in doc["rows"] if "host_syncs_per_step" in r) == [
        (p, s, v) for p in ("bf16", "nvfp4") for s in (False, True) for v in ("eager", "megatron")]
    assert all(r["host_syncs_per_step"] is None for r in doc["rows"] if "host_syncs_per_step" in r)
    floors = {(r["precision"], r["batch"]): r["floor_ms"] for r in doc["rows"]}
    assert floors[("nvfp4", 3)] < floors[("bf16", 3)] and floors[("bf16", 1)] < floors[("bf16", 3)]
    assert [r["batch"] for r in doc["reference_rows"]] == [1, 3]
    for r in doc["reference_rows"]:
        assert r["graph"] is False and math.isfinite(r["step_ms"]) and r["step_ms"] > 0
    table = subprocess.run([sys.executable, str(BENCH), "--render", str(out)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert table[4].startswith("| precision | mode | loop | batch |")
    assert len([t for t in table if t.startswith("| BF16")]) == 8 and any("| eager, gumbel | 3 |" in t for t in table)
    assert any(t.startswith("| 3 | ") for t in table)


def test_latest_keeps_the_newest_row_of_each_configuration():
    def row(precision, strict, batch, step, commit):
        return {"precision": precision, "strict": strict, "batch": batch, "step_ms": step, "commit": commit}

    doc = {"rows": [row("nvfp4", False, 64, 2.0, "a"), row("nvfp4", True, 64, 2.5, "a"),
                    row("bf16", False, 64, 3.0, "a"), row("nvfp4", False, 64, 1.9, "b"), row("nvfp4", False, 8, 1.4, "b")],
           "reference_rows": [{"batch": 64, "commit": "a"}, {"batch": 64, "commit": "b"}],
           "errors": [{"error": "x"}], "commit": "b"}
    got = bench_rollout.latest(doc)
    assert [(r["precision"], r["strict"], r["batch"], r["commit"]) for r in got["rows"]] == [
        ("nvfp4", False, 64, "b"), ("nvfp4", True, 64, "a"), ("bf16", False, 64, "a"), ("nvfp4", False, 8, "b")]
    assert got["reference_rows"] == [{"batch": 64, "commit": "b"}] and got["errors"] == []
    assert len(doc["rows"]) == 5  # the file's rows are left as they are


class _CapturingEngine:
    """What measure_engine reads of miniTE's engine: generate, and a decoder that counts its graph captures. Each
    generate captures `first_captures[k]` steps on its k-th call (a shape's first step is captured one generate late)."""

    loop = "minite"

    def __init__(self, first_captures):
        self.decoder = type("Decoder", (), {"captures": 0, "time_decode": False, "last_decode": (0.01, 4)})()
        self.first_captures, self.calls = list(first_captures), 0

    def generate(self, prompts, params):
        if self.calls < len(self.first_captures):
            self.decoder.captures += self.first_captures[self.calls]
        self.calls += 1


@pytest.mark.parametrize("first_captures,warm_calls,timed_captures", [
    ([38, 6, 1, 1], 6, 0),       # miniTE's loop: the first step of each shape is captured in its second generate
    ([38, 6], 4, 0),             # captured in one pair: one more pair confirms
    ([1] * 20, 6, 2),            # a graph captured every time (evicted): warming stops, the row counts them
])
def test_warm_up_keeps_captures_out_of_the_timed_runs(first_captures, warm_calls, timed_captures):
    a = bench_rollout.parse(["--tiny", "--batches", "2"])
    engine = _CapturingEngine(first_captures)
    row = bench_rollout.measure_engine(engine, a, bench_rollout.TINY, "bf16", False, 2)
    assert engine.calls == warm_calls + 2 * a.repeats
    assert row["graph_captures_timed"] == timed_captures
    assert row["step_method"] == "events" and row["step_ms"] == pytest.approx(0.01 / 4 * 1e3)
