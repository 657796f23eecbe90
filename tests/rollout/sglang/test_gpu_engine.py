"""SGLang's GPU path with the minite_nvfp4 plugin (marker `gpu`): the engine on one GPU with SGLang's Triton attention
backend, eager and with decode CUDA graphs, generating with log-probs, and taking weight updates from CUDA tensors.

Skipped, saying why, without a CUDA GPU of sm_90 or later (tests/conftest.py), without sglang 0.5.23, or without
SGLang's CUDA kernels (`sglang-kernel`): SGLang 0.5.23 imports them at module level on CUDA (docs/sglang.md, "SGLang
on the H200", lists where), so its GPU path does not start without them. The GPU machines of this project have no
sglang-kernel; tools/sglang_gpu_probe.sh measures how far SGLang gets there with a test-only stand-in instead.
"""
from __future__ import annotations

import importlib.metadata
import json
import math

import pytest

from tests.rollout.sglang.conftest import sglang_skip_reason, tiny_hf_checkpoint


def _stand_in() -> bool:
    """The test-only sgl_kernel stand-in (tests/rollout/sglang/gpu_stand_ins) is what `import sgl_kernel` finds: the
    device runs put it on PYTHONPATH; SGLang's fused ops then take their PyTorch bodies (set below)."""
    try:
        import sgl_kernel
    except ImportError:
        return False
    return "minite.gpu.stand.in" in getattr(sgl_kernel, "__version__", "")


def _reason():
    reason = sglang_skip_reason()
    if reason is not None:
        return reason
    if _stand_in():
        return None
    for dist in ("sglang-kernel", "sgl-kernel"):
        try:
            importlib.metadata.version(dist)
            return None
        except importlib.metadata.PackageNotFoundError:
            pass
    return ("needs sglang-kernel built for this torch (SGLang's CUDA path imports sgl_kernel at module level), or the "
            "test stand-in tests/rollout/sglang/gpu_stand_ins first on PYTHONPATH")


# with the stand-in (the device's torch 2.11 vs the pins of SGLang's compiled parts): SGLang's fused ops in PyTorch,
# no radix cache (its Rust tree core misread int64 indices there), torch sampling, no deterministic inference
STAND_IN_ARGS = {"sampling_backend": "pytorch", "disable_radix_cache": True, "enable_deterministic_inference": False}


@pytest.fixture(autouse=True)
def _stand_in_env(monkeypatch):
    if _stand_in():
        monkeypatch.setenv("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")
        monkeypatch.setenv("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")


_REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _learner_tensors(hf_dir):
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf

    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    return cfg, [(n, t.clone()) for n, t in megatron_view_of_hf(_HFReader(hf_dir), cfg)]


def _run(engine):
    from minite.rollout.base import SamplingParams

    out = engine.generate(PROMPTS, SamplingParams(temperature=1e-6, max_new_tokens=8, n=2, seed=7))
    return [(r.prompt_index, r.tokens, r.logprobs) for r in out]


def _load_cuda(engine, named):
    """The backend's update from CUDA tensors: sent from the GPU (send_from_gpu, the default: CUDA IPC handles)."""
    assert engine.send_from_gpu
    engine.update_weights([(n, t.cuda()) for n, t in named])
    assert all(flat.device.type == "cpu" for flat, _ in engine._last_good)  # the restore copy is on the host


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_generate_and_update_from_cuda_tensors(tmp_path, graphs):
    from minite.nvfp4 import NVFP4Recipe
    from minite.rollout.sglang.engine import start_from_learner_tensors

    cfg, w1 = _learner_tensors(tiny_hf_checkpoint(tmp_path / "w1", seed=1))
    _, w2 = _learner_tensors(tiny_hf_checkpoint(tmp_path / "w2", seed=2))
    args = {"attention_backend": "triton", "disable_cuda_graph": not graphs, "mem_fraction_static": 0.3,
            "max_total_tokens": 8192, **(STAND_IN_ARGS if _stand_in() else {})}
    if graphs:
        args["cuda_graph_bs_decode"] = [1, 2, 4]
    engine = start_from_learner_tensors(w1, cfg, NVFP4Recipe(), engine_args=args)
    try:
        first = _run(engine)
        assert _run(engine) == first  # greedy decoding reproduces, log-probs bit for bit
        for _i, tokens, logprobs in first:
            assert len(tokens) == len(logprobs) == 8
            assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        engine.update_weights(w2)
        assert _run(engine) != first
        _load_cuda(engine, w1)
        assert _run(engine) == first  # the same packed weights from CUDA tensors: the same tokens and log-probs
    finally:
        engine.shutdown()


def test_strict_gap_is_zero_on_the_gpu():
    """`minite diagnose --b sglang --set alignment.strict=true --fail-above 0`'s comparison on the GPU: SGLang with the
    learner's strict ops (torch_native attention, eager, selected by build_sglang) against the learner."""
    from minite.alignment.diagnose import DiagnoseParams, run_diagnose
    from minite.config import load_config

    extra = "{disable_radix_cache: true, mem_fraction_static: 0.3}"
    cfg = load_config("examples/tiny/nvfp4.yaml", ["rollout.backend=sglang", "alignment.strict=true",
                                                   f"rollout.sglang_args={extra}"])
    r = run_diagnose(cfg, "sglang", DiagnoseParams(num_prompts=6, max_new_tokens=8, max_prompt_len=12))
    assert r["tokens_compared"] > 0 and r["max_abs_logp_gap"] == 0.0, r["histogram"]
