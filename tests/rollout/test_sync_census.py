"""tools/bench/sync_census.py: a decode step's host synchronisations counted on the CPU, with the sites that would not
synchronise on a GPU set apart. Its list of those sites finds our files' lines by their text: with line numbers
written in, an edit of minite/nvfp4/quantize.py had moved the CPU's NaN check off its entry, and the census counted
it as 8 GPU synchronisations per NVFP4 decode step (2026-12-05)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))


def test_the_nvfp4_kernel_path_decodes_without_a_gpu_synchronisation():
    import sync_census

    engine = sync_census.engine_for("nvfp4", False, 1, "triton")
    per_step, _ = sync_census.census(engine, batch=2)
    on_gpu = {k: n for k, n in per_step.items() if not sync_census.cpu_only(k[1], "nvfp4", "default", True)}
    assert per_step and not on_gpu, on_gpu  # candidates exist on the CPU, none of them on a GPU
    check = sync_census.CPU_ONLY[next(k for k in sync_census.CPU_ONLY if k.startswith("minite/nvfp4/quantize.py:"))]
    assert any(site[0].startswith("minite/nvfp4/quantize.py:") for _, site in per_step) and "NaN/Inf" in check


def test_sites_are_found_by_their_text():
    import pytest
    import sync_census

    assert sync_census.NVFP4_HOST_COUNTS.startswith("megatron_patches/nvfp4_layers.py:")
    with pytest.raises(RuntimeError, match="is on 0 lines of minite/nvfp4/quantize.py, expected one"):
        sync_census._line("minite/nvfp4/quantize.py", "no such text in the file")


def test_the_nvfp4_learner_step_adds_no_gpu_synchronisation_to_bf16s():
    """One Learner train step of 4 micro-batches (the NVFP4 expert wgrads through DeferredWgrads, two a launch, on the
    kernels' host code under the interpreter): every site that would synchronise on a GPU in NVFP4 is one BF16 has
    too. A pageable copy of the wgrad flush's offsets (kernels/nvfp4_wgrad.py `_segment_table`) was 32 synchronisations
    of an 8-micro-batch step on an H100 (2026-12-05) that this census would have shown as such a site."""
    import sync_census

    def gpu_sites(precision):
        counts = sync_census.learner_census(precision, micro_batches=4)
        return {(kind, site[0]) for (kind, site), n in counts.items()
                if n and not sync_census.cpu_only(site, precision, "default", True)}, counts

    bf16, _ = gpu_sites("bf16")
    nvfp4, counts = gpu_sites("nvfp4")
    assert any(site and site[0].startswith("minite/nvfp4/device_copy.py:") for _, site in counts)  # the kernels' path
    assert not nvfp4 - bf16, sorted(nvfp4 - bf16)


def test_the_rl_loops_micro_batch_reads_nothing_back_from_the_gpu():
    """The RL loop's training on a batch (minite.rl.loop.train_on_batch: the GRPO loss over host-side batch tensors,
    the learner's gradient accumulation), BF16: one more micro-batch adds no site that would synchronise on a GPU.
    Before 2026-12-05 it added eleven: five `.item()` of the GRPO metrics, four pageable copies of the loop's batch
    tensors into the loss, two of the token ids into the learner (the census counted twelve: it cannot see that the
    learner's old log-probs already live on the GPU, where their `.to` is no copy)."""
    import sync_census

    per = sync_census.rl_per_micro_batch("bf16")
    on_gpu = {k: n for k, n in per.items() if not sync_census.cpu_only(k[1], "bf16", "default", True)}
    assert any(site and site[0].startswith("minite/nvfp4/device_copy.py:") for _, site in per)  # the copies are seen
    assert not on_gpu, on_gpu
