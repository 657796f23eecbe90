"""The RL loop on one GPU (`minite.rl.loop.train`, real Learner and embedded engine on cuda:0): a few NVFP4 steps
run with the learner on the GPU and finite metrics; a run interrupted after its checkpoint and resumed (CUDA RNG
states included) equals the uninterrupted run bitwise, metrics and saved state; strict mode gives a learner/rollout
gap of exactly 0 on every step."""
import os

import pytest
import torch

from minite.config import load_config
from minite.rl import checkpoint as ckpt
from minite.rl.loop import train

pytestmark = pytest.mark.gpu
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode (read at its first use)
STEPS = 4


def _cfg(tmp_path, run, steps, **extra):
    sets = {"precision.mode": "nvfp4", "rl.steps": steps, "rl.warmup_steps": 2, "rl.prompts_per_step": 4,
            "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.task_length": 3, "rl.minibatches": 2,
            "logging.dir": str(tmp_path / run), "logging.progress_bar": False, **extra}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _untimed(history):
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in history]


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def deterministic():
    """Deterministic CUDA kernels where torch has them (scatter/index adds of the MoE combine and the embedding
    backward use atomics otherwise), so two runs can be compared bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_rl_steps_on_one_gpu_and_resume_bitwise(tmp_path, deterministic):
    every = {"checkpoint.every": 1, "checkpoint.keep": 0}
    straight = train(_cfg(tmp_path, "a", STEPS, **{"checkpoint.dir": str(tmp_path / "cka"), **every}))
    assert len(straight) == STEPS
    again = train(_cfg(tmp_path, "a2", STEPS))
    assert _untimed(again) == _untimed(straight), "two uninterrupted GPU runs differ: a nondeterministic kernel, " \
                                                  "not the resume, would break the comparison below"
    state = ckpt.load_checkpoint(tmp_path / "cka" / f"step_{STEPS:06d}")
    assert "cuda" in state["rng"]  # the CUDA generators are saved
    assert all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in straight)
    train(_cfg(tmp_path, "b", STEPS // 2, **{"checkpoint.dir": str(tmp_path / "ckb"), **every}))
    torch.manual_seed(1234)
    torch.cuda.manual_seed_all(1234)  # a new process would start from other CUDA generator states
    resumed = train(_cfg(tmp_path, "b", STEPS, **{"checkpoint.dir": str(tmp_path / "ckb"), **every}))
    assert _untimed(straight[STEPS // 2:]) == _untimed(resumed)
    assert _same(state, ckpt.load_checkpoint(tmp_path / "ckb" / f"step_{STEPS:06d}"))


def test_strict_gap_is_exactly_zero_on_every_step(tmp_path):
    history = train(_cfg(tmp_path, "s", 3, **{"alignment.strict": True}))
    assert [h["mismatch/logp_abs_max"] for h in history] == [0.0] * 3


def test_cuda_out_of_memory_is_the_one_line_error(tmp_path):
    """A CUDA allocation that cannot fit becomes OutOfMemoryRunError naming the size asked for (the CPU tests feed
    stop_cleanly a constructed torch.OutOfMemoryError; this one is CUDA's own)."""
    from minite.rl.failures import OutOfMemoryRunError, stop_cleanly

    cfg = _cfg(tmp_path, "oom", 1)
    pattern = r"^out of memory at RL step 1 of 1 \(an allocation of [\d.]+ [KMGTP]?i?B on the GPU\): a step's rows"
    with pytest.raises(OutOfMemoryRunError, match=pattern):
        with stop_cleanly(cfg, "at RL step 1 of 1"):
            torch.empty(2**50, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_one_more_micro_batch_adds_no_host_synchronisation(precision):
    """The RL loop's training on a batch (train_on_batch: the GRPO loss over the loop's host tensors, the learner's
    gradient accumulation) with 4 micro-batches synchronises the host with the GPU as often as with 2: torch's sync
    debug mode counts them (the step's own reads, the optimizer's gradient norm and the metrics, happen once in
    both). What tools/bench/sync_census.py --rl counts on the CPU; eleven a micro-batch before 6c2086a."""
    import collections
    import sys
    import warnings
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
    import sync_census
    from profiling import SYNC_WARNING
    from minite.rl.loop import train_on_batch

    def syncs(micro_batches):
        run, batch, advantages = sync_census.rl_inputs(precision, micro_batches, backend="auto")
        train_on_batch(run, batch, advantages)  # warm-up: quantised weights, compiled kernels, pinned buffers
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_on_batch(run, batch, advantages)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        run.learner.close()
        return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                   if SYNC_WARNING in str(w.message))

    two, four = syncs(2), syncs(4)
    assert sum(two.values()) > 0  # the counter works: the step's own reads are seen
    # the sites (the Python line under each warning) in the message: where a count differs, which line did it
    assert sum(four.values()) == sum(two.values()), (sorted((two - four).items()), sorted((four - two).items()), two)
