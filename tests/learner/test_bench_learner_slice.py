"""tools/bench/bench_learner_slice.py on the CPU (--tiny): one row per precision and micro-batch count with the fixed
keys (precision, tokens_per_s, fwd_bwd_s, optimizer_s, model_tflops, peak_mem_gib), the RL-sized row's tokens
scaled by its micro-batches, and the NVFP4/BF16 ratios."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_learner_slice_tiny_rows(tmp_path):
    out = tmp_path / "slice.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench/bench_learner_slice.py"), "--tiny", "--layers", "1",
                           "--seq", "32", "--steps", "1", "--warmup", "0", "--micro-batches", "1,2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["precision"], r["micro_batches"]) for r in rows] == [("bf16", 1), ("bf16", 2), ("nvfp4", 1),
                                                                     ("nvfp4", 2)], rows
    for r in rows:
        assert {"precision", "tokens_per_s", "fwd_bwd_s", "optimizer_s", "model_tflops", "peak_mem_gib"} <= set(r)
        assert r["tokens"] == 32 * r["micro_batches"] and r["tokens_per_s"] > 0 and 0 < r["optimizer_s"] < r["step_s"]
        assert len(r["steps_s"]) == 1 and r["steps_s"][0] == round(r["step_s"], 5)  # every timed step, kept
        assert len(r["optimizer_steps_s"]) == 1
    assert set(doc["nvfp4_over_bf16_tokens_per_s_by_micro_batches"]) == {"1", "2"}
    assert doc["nvfp4_over_bf16_tokens_per_s"] == doc["nvfp4_over_bf16_tokens_per_s_by_micro_batches"]["1"]
    assert {"date", "commit", "command"} <= set(doc) and "bench_learner_slice.py" in doc["command"]


def test_benchmark_commit_says_when_the_tree_is_not_its_head(tmp_path):
    """tools/bench/provenance.py: MINITE_COMMIT when set; else git's HEAD, with +dirty once a tracked file differs
    (a device's copy of the tree whose git metadata is older than its files must not name a commit silently), and
    the kernels MINITE_TRY_KERNELS routes."""
    import shutil
    repo = tmp_path / "repo"
    (repo / "tools" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "bench" / "provenance.py", repo / "tools" / "bench" / "provenance.py")
    (repo / "kernel.py").write_text("# measured\n")
    git = dict(cwd=repo, check=True, capture_output=True)
    subprocess.run(["git", "init", "-q"], **git)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x", "--allow-empty"], **git)
    subprocess.run(["git", "add", "."], **git)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "y"], **git)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True, **git).stdout.strip()

    def commit(**env):
        code = "import sys; sys.path.insert(0, 'tools/bench'); import provenance; print(provenance.commit())"
        return subprocess.run([sys.executable, "-c", code], cwd=repo, text=True, check=True, capture_output=True,
                              env={k: v for k, v in dict(os.environ, **env).items()
                                   if k not in ("MINITE_COMMIT", "MINITE_TRY_KERNELS") or k in env}).stdout.strip()

    assert commit() == head
    (repo / "kernel.py").write_text("# changed after the commit\n")
    assert commit() == head + "+dirty"
    assert commit(MINITE_COMMIT="abc1234") == "abc1234"
    # kernels routed before their GPU test passed: the commit alone does not run what was measured
    assert commit(MINITE_COMMIT="abc1234", MINITE_TRY_KERNELS=" expert_swiglu,combine_rows_dtype,") == \
        "abc1234+MINITE_TRY_KERNELS=combine_rows_dtype,expert_swiglu"
    assert commit(MINITE_TRY_KERNELS="expert_swiglu") == head + "+dirty+MINITE_TRY_KERNELS=expert_swiglu"


def test_memory_peak_replay_finds_the_blocks_alive_at_the_peak():
    """tools/bench/memory_peak.py's replay of allocator events: the peak and, by allocation site, what is alive at
    its first moment (a later equal total is not the peak; frees of blocks older than the replay come off the
    "before the call" line)."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from memory_peak import alive_at_peak

    def frame(path, line):
        return [{"filename": "/usr/lib/python3/x.py", "line": 1, "name": "inner"},
                {"filename": f"/r/minite/{path}", "line": line, "name": "f"}]

    ev = lambda action, addr, size, path="ops/a.py", line=3: {"action": action, "addr": addr, "size": size,  # noqa
                                                               "frames": frame(path, line)}
    events = [ev("alloc", 1, 100), ev("alloc", 2, 50, "ops/b.py", 9), ev("free_requested", 1, 100),
              ev("free_completed", 1, 100), ev("free_completed", 77, 30), ev("alloc", 3, 120, "ops/a.py", 3),
              ev("segment_alloc", 9, 4096), ev("alloc", 4, 20), ev("free_completed", 4, 20), ev("alloc", 5, 20)]
    peak, at_peak = alive_at_peak(events, 1000)
    assert peak == 1000 - 30 + 50 + 120 + 20
    assert at_peak == {"before the call": 970, "ops/b.py:9 f": 50, "ops/a.py:3 f": 140}
    assert alive_at_peak([], 5) == (5, {"before the call": 5})


def test_busy_span_is_the_union_of_overlapping_kernels():
    """tools/bench/profiling.busy_span: overlapping and touching intervals count once, gaps are idle, order does not
    matter; no intervals is an empty span."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from profiling import busy_span

    assert busy_span([(10, 20), (0, 5), (15, 30), (30, 31), (40, 41)]) == (41, 5 + 21 + 1)
    assert busy_span([(3, 4), (1, 9)]) == (8, 8)
    assert busy_span([]) == (0.0, 0.0)


def test_op_sites_name_the_repository_line_that_copied():
    """tools/bench/profiling.print_op_sites: each copy counted once (a _to_copy's inner copy_ is not counted again) at
    the nearest line of the repository's code, and a copy run by a built-in autograd node names that node."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import torch
    from profiling import print_op_sites

    from minite.nvfp4 import quantize  # repository code that casts
    x = torch.randn(3, 32, requires_grad=True)

    def step():
        quantize(x.detach().to(torch.bfloat16))  # one cast here, the quantiser's own inside minite/nvfp4/
        x.to(torch.bfloat16).float().sum().backward()  # two casts here, two by ToCopyBackward0 (to bf16, to fp32)

    sites = print_op_sites(step, ["aten::copy_", "aten::_to_copy"], 10, show=False)
    ours = [k for k in sites if "minite/" in k]
    assert ours and all(k.split(" ", 1)[1].startswith("minite/") for k in ours), sites
    backward = [v for k, v in sites.items() if "[autograd ToCopyBackward0]" in k]
    assert sum(n for n, _, _ in backward) == 2 and sum(b for _, b, _ in backward) == 3 * 32 * (2 + 4), sites
    here = [n for k, (n, _, _) in sites.items() if k.startswith("aten::_to_copy") and "[autograd" not in k and
            "minite/" not in k]
    assert sum(here) == 3, sites  # the three casts of step() itself, at this test's frame


def test_phases_time_each_wrapped_call_in_order_and_put_the_originals_back():
    """tools/bench/profiling.print_phases: one span per call of a wrapped attribute (a nested one inside its caller's),
    in call order, and the attributes as they were afterwards (also when the call fails)."""
    import time
    import types
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from profiling import print_phases

    mod = types.SimpleNamespace(inner=lambda: time.sleep(0.002))
    obj = types.SimpleNamespace(outer=lambda: (time.sleep(0.001), mod.inner()), other=lambda: None)
    originals = (mod.inner, obj.outer, obj.other)

    def step():
        obj.outer()
        time.sleep(0.003)  # "between"
        obj.other()

    spans = print_phases(step, [(obj, "outer", "outer"), (mod, "inner", "inner"), (obj, "other", "other")], show=False)
    assert [p for p, _, _ in sorted(spans, key=lambda s: s[1])] == ["outer", "inner", "other"]
    (o, os_, oe), (i, is_, ie), (x, xs, _) = sorted(spans, key=lambda s: s[1])
    assert os_ <= is_ < ie <= oe and ie - is_ >= 0.002 and xs - oe >= 0.003
    assert (mod.inner, obj.outer, obj.other) == originals
    obj.other = failing = lambda: 1 / 0
    try:
        print_phases(step, [(obj, "other", "other")], show=False)
    except ZeroDivisionError:
        pass
    assert obj.other is failing
