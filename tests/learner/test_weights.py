"""minite/learner/weights.py: a checked weight copy reads the finiteness of all tensors back in one host read (not one
per tensor), still names the first non-finite tensor, and copies nothing when any tensor is rejected."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.learner.weights import WeightUpdateError, checked_weight_copy


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (bool(t), t.item(): one synchronisation each on a
    GPU) and the stacked read-back (`tolist` of a device tensor goes through a copy to the CPU there; on the CPU it
    reads memory directly, so it is counted as the one `stack` whose result is read)."""

    def __init__(self):
        super().__init__()
        self.scalar_reads = 0
        self.stacks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        if func is torch.ops.aten.stack.default:
            self.stacks += 1
        return func(*args, **(kwargs or {}))


def _params(n=5):
    return {f"layer{i}.weight": torch.zeros(3, 4) for i in range(n)}


def test_one_host_read_for_the_whole_update():
    params = _params()
    update = [(f"module.{k}", torch.randn(3, 4)) for k in params]
    with _HostReads() as reads:
        assert checked_weight_copy(params, update) == 5
    assert reads.scalar_reads == 0 and reads.stacks == 1
    assert all(torch.equal(params[k], t) for (_, t), k in zip(update, params))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_tensor_is_named_and_nothing_is_copied(bad):
    params = _params()
    update = [(k, torch.randn(3, 4)) for k in params]
    update[3][1][1, 2] = bad
    update[4][1][0, 0] = float("nan")  # a later offender: the first one is named
    with pytest.raises(WeightUpdateError, match=r"weight 'layer3.weight' is not a finite floating-point tensor"):
        checked_weight_copy(params, update)
    assert all(torch.count_nonzero(p) == 0 for p in params.values())


def test_other_rejections_keep_their_messages():
    params = _params(2)
    good = [(k, torch.randn(3, 4)) for k in params]
    for update, msg in [([("nope", torch.randn(3, 4))], "unknown weight 'nope'"),
                        ([good[0], good[0]], "given twice"),
                        ([("layer0.weight", torch.randn(4, 3))], r"has shape \(4, 3\)"),
                        ([("layer0.weight", torch.ones(3, 4, dtype=torch.int32)), good[1]], "not a finite"),
                        (good[:1], "incomplete weight update: 1 parameters missing")]:
        with pytest.raises(WeightUpdateError, match=msg):
            checked_weight_copy(params, update)
    assert all(torch.count_nonzero(p) == 0 for p in params.values())


def test_empty_and_mixed_dtype_tensors_are_checked_together():
    """aminmax refuses an empty tensor (an empty one is finite); tensors of several dtypes are read back together."""
    params = {"a": torch.zeros(0, 4), "b": torch.zeros(2, 3, dtype=torch.bfloat16), "c": torch.zeros(5, dtype=torch.float64)}
    update = [("a", torch.empty(0, 4)), ("b", torch.randn(2, 3).bfloat16()), ("c", torch.randn(5, dtype=torch.float64))]
    assert checked_weight_copy(params, update) == 3
    update[1][1][1, 1] = float("inf")
    update[2][1][4] = float("nan")
    with pytest.raises(WeightUpdateError, match="weight 'b' is not a finite"):
        checked_weight_copy(params, [update[0], update[1], ("c", torch.randn(5, dtype=torch.float64))])
    with pytest.raises(WeightUpdateError, match="weight 'c' is not a finite"):
        checked_weight_copy(params, [update[0], ("b", torch.randn(2, 3).bfloat16()), update[2]])
