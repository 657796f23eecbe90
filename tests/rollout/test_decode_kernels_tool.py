"""tools/bench/decode_kernels.py on the CPU: a step is what lies between two sampler pick kernels, its summary
(count, span, busy time, per-name totals, gaps) is computed from the events as given, and without CUDA the tool
refuses in one line. tools/bench/bench_decode_attention.py: its inputs are the decode step's SDPA call, and without
CUDA it refuses in one line too."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))


def test_steps_are_cut_at_the_samplers_pick_and_summarised():
    import decode_kernels as dk
    ev = [(0.0, 50.0, "prefill_gemm"), (50.0, 52.0, "_pick_kernel"),  # the prefill's step: dropped
          (53.0, 60.0, "gemm"), (61.0, 64.0, "norm"), (70.0, 73.0, "norm"), (73.5, 75.0, "_pick_kernel"),
          (76.0, 80.0, "gemm"), (80.5, 82.0, "_pick_kernel"), (83.0, 84.0, "after the last step")]
    found = dk.steps(ev)
    assert [len(s) for s in found] == [4, 2] and found[0][0][2] == "gemm" and found[1][-1][2] == "_pick_kernel"
    row = dk.summarise(found[0])
    assert row["kernels"] == 4 and row["span_us"] == 22.0 and row["busy_us"] == 14.5
    assert row["by_name"][0] == ["gemm", 1, 7.0] and row["by_name"][1] == ["norm", 2, 6.0]
    assert [r[1] for r in row["sequence"]] == [0.0, 1.0, 6.0, 0.5]  # the gaps before each kernel
    assert dk.steps([(0.0, 1.0, "gemm")]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the tool would run")
def test_without_cuda_it_says_so(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools/bench/decode_kernels.py"), "--out", str(tmp_path / "k.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "a GPU tool" in proc.stderr and not (tmp_path / "k.json").exists()


def test_decode_attention_bench_times_the_decode_steps_sdpa_call():
    """The benchmark's q, k, v are what megatron_patches.qwen3_moe.sdpa_attention hands SDPA for one query over a
    [context, b, groups, hn] cache: the same output, bit for bit, from the cache and queries they view."""
    import torch.nn.functional as F

    import bench_decode_attention as bda
    from minite.megatron_patches.qwen3_moe import sdpa_attention
    q, k, v = bda.decode_inputs(3, 5, groups=2, rep=4, hn=16, device="cpu")
    cache_k, cache_v = (t.permute(2, 0, 1, 3) for t in (k, v))  # back to [context, b, groups, hn]
    assert cache_k.is_contiguous() and cache_v.is_contiguous()  # views of a cache's storage, as in a decode step
    query = q.reshape(1, 3, 8, 16)  # [1, b, heads, hn], head i of group i // rep
    got = sdpa_attention(query, cache_k, cache_v, 0.25, causal=False)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.25).reshape(1, 3, 8 * 16)
    assert got.shape == (1, 3, 128) and torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the tool would run")
def test_decode_attention_bench_without_cuda_says_so(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools/bench/bench_decode_attention.py"), "--out", str(tmp_path / "a.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr and not (tmp_path / "a.json").exists()
