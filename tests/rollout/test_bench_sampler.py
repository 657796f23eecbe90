"""tools/bench/bench_sampler.py on the CPU: it refuses to time without CUDA, its ops run, and its other layouts of
the Gumbel kernels (under Triton's interpreter here) give the reference's tokens of the same layout."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the benchmark would run")
def test_without_cuda_it_says_so(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools/bench/bench_sampler.py"), "--out", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr and not (tmp_path / "s.json").exists()


def test_its_ops_run_and_its_layouts_are_the_references():
    import bench_sampler

    from minite.rollout import sampling as S

    x = torch.randn(3, 2500) * 3
    ops = bench_sampler._ops(x, torch.tensor([0, 7, 2499]), torch.Generator().manual_seed(0))
    for name, f in ops.items():
        out = f()
        assert out.shape[0] == 3 and bool(torch.isfinite(out.float()).all()), name
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the layouts run compiled (bench_sampler.py --layouts), not on CPU tensors")
    for quarter, warps in ((256, 2), (512, 4)):
        launch, equal = bench_sampler._layout(x, quarter, warps)
        assert equal is True, (quarter, warps)
    assert (S.QUARTER, S.CHUNK) == (1024, 4096)  # the layouts are arguments: the module keeps its own
