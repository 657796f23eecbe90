"""The NVFP4 decode path's NaN/Inf check without a host synchronisation per quantisation: `FiniteFlag` records on the
device and is read once per generate; the embedded engine raises a one-line error when a weight or activation that
reached a quantiser was not finite, and the check changes no token or log-prob. On the CPU the quantiser checks its
input itself; the GPU test (marker gpu) drives the deferred path through the model's NVFP4 modules."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.config import load_config
from minite.ops import FiniteFlag
from minite.rollout import SamplingParams
from minite.rollout.embedded import build_embedded

TINY = ["model.vocab_size=64", "model.max_position_embeddings=32", "precision.mode=nvfp4"]
MESSAGE = r"NaN or Inf reached an NVFP4 quantiser during generate"


class _ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_flag_records_without_reading_and_checks_once(bad):
    flag = FiniteFlag()
    flag.check("nothing")  # nothing recorded: no-op
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with _ScalarReads() as reads:
        flag.record(x)
        flag.record(x.new_zeros(0, 32))  # empty: ignored
        flag.check("a finite step")
    assert reads.n == 1  # the check's one read; record reads nothing back
    y = x.clone()
    y[2, 5] = bad
    flag.record(x)
    flag.record(y)
    flag.record(x)  # a later finite tensor does not hide the earlier one
    with pytest.raises(ValueError, match="NaN or Inf reached an NVFP4 quantiser during step 3"):
        flag.check("step 3")
    flag.check("step 4")  # reset by the check that raised


@pytest.fixture(scope="module")
def engine():
    return build_embedded(load_config(None, TINY))


def _generate(engine):
    out = engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=4, n=2, seed=3))
    return [(r.tokens, r.logprobs) for r in out]


def test_engine_reads_the_flag_once_per_generate(engine):
    first = _generate(engine)
    engine.nvfp4.record_finite(torch.tensor([float("nan")]))  # on the CPU the quantiser checks itself: not recorded
    assert _generate(engine) == first
    engine.nvfp4.finite.record(torch.tensor([float("nan")]))  # as a GPU module would record it
    with pytest.raises(ValueError, match=MESSAGE):
        _generate(engine)
    assert _generate(engine) == first  # reset, and the check changed no token or log-prob


def _modules_record_and_check(engine):
    """The deferred path through the model's NVFP4 modules: a linear and the experts record what they quantise (no
    host read on the way), the check raises once, and none of it changes a token or log-prob. (Driven at the
    modules: a whole generate with non-finite logits stops on its NaN log-probs first, tests/rollout/test_decode.py.)"""
    from minite.megatron_patches.nvfp4_layers import GroupedExperts, NVFP4ColumnParallelLinear

    model = engine.model
    dev = next(model.parameters()).device
    first = _generate(engine)
    linear = next(m for m in model.modules() if isinstance(m, NVFP4ColumnParallelLinear))
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    x = torch.randn(3, 2, linear.weight.shape[1], dtype=torch.bfloat16, device=dev)
    with torch.no_grad(), _ScalarReads() as reads:
        linear(x)
    assert reads.n == 0  # no value read back on the NVFP4 linear's path, the record included
    if dev.type == "cuda":  # and no synchronising CUDA operation at all (torch raises on one in this mode)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                linear(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.nvfp4.finite.check("a finite forward")
    x[1, 0, 7] = float("nan")
    with torch.no_grad():
        linear(x)
    with pytest.raises(ValueError, match=MESSAGE):
        engine.nvfp4.finite.check("generate")
    saved = experts.fc1_weight.data.clone()
    experts.fc1_weight.data[0, 3, 5] = float("inf")  # a weight is recorded when its quantisation is (re)made
    engine.nvfp4.weights_updated()
    try:
        rows = torch.randn(4, saved.shape[-1], dtype=torch.bfloat16, device=dev)
        counts = [4] + [0] * (experts.num_local_experts - 1)
        with torch.no_grad():
            experts(rows, torch.tensor(counts), torch.ones(4, device=dev))
        with pytest.raises(ValueError, match=MESSAGE):
            engine.nvfp4.finite.check("generate")
    finally:
        experts.fc1_weight.data.copy_(saved)
        engine.nvfp4.weights_updated()
    assert _generate(engine) == first


def test_deferred_path_on_cpu(engine, monkeypatch):
    """The GPU's path run on the CPU: the quantiser told not to check (as on a GPU), so the modules record."""
    import minite.megatron_patches.nvfp4_layers as layers
    from minite.ops import common

    monkeypatch.setattr(common, "quantiser_checks_finite", lambda t: False)
    monkeypatch.setattr(layers, "quantiser_checks_finite", lambda t: False)
    _modules_record_and_check(engine)


@pytest.mark.gpu
def test_gpu_modules_record_without_host_reads(engine):
    assert next(engine.model.parameters()).is_cuda
    _modules_record_and_check(engine)
