"""The diagnose machinery on toy models: capture, first divergent op, local vs propagated origin, gap statistics."""
import copy

import torch

from minite.alignment.capture import Capture
from minite.alignment.compare import compare_ops, first_divergence, logprob_gap
from minite.strict import ops as strict_ops
from tests.tolerances import TOLERANCES


class RMSNorm(torch.nn.Module):
    """Row-wise RMSNorm whose result cannot depend on how many rows one call holds: a fixed-order tree sum
    (strict_ops). torch.nn.RMSNorm/Linear make no such promise: on an AVX-512 CPU a full-batch fp32 Linear and
    row-by-row calls differ by ~1.5e-7, which these tests would misread as a divergence."""

    def __init__(self, width, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return strict_ops.rms_norm(x, self.weight, self.eps)


class Linear(torch.nn.Module):
    """x @ W^T + b with a fixed-order sum over K (strict_ops.linear): row-local by construction."""

    def __init__(self, width):
        super().__init__()
        ref = torch.nn.Linear(width, width)
        self.weight, self.bias = ref.weight, ref.bias

    def forward(self, x):
        return strict_ops.linear(x, self.weight) + self.bias


class Block(torch.nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.norm = RMSNorm(16, eps=eps)
        self.fc = Linear(16)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Toy(torch.nn.Module):
    """Position-wise (no attention), so a prefill + decode steps sees the same rows as one full forward."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block(), Block()])
        self.shift = 0.0

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 2:
                x = x + self.shift  # a functional op no hook sees
            x = layer(x)
        return x


def _run_incremental(model, x, prefill=3):
    with Capture(model) as cap:
        model(x[:prefill])
        for s in range(prefill, x.shape[0]):
            model(x[s:s + 1])
    return cap


def _run_full(model, x):
    with Capture(model) as cap:
        model(x)
    return cap


def test_identical_engines_agree_exactly_including_incremental_calls():
    torch.manual_seed(0)
    a = Toy()
    x = torch.randn(7, 2, 16)
    diffs = compare_ops(_run_full(a, x).ordered(), _run_incremental(copy.deepcopy(a), x).ordered())
    assert [d.name for d in diffs][:2] == ["layers.0.norm", "layers.0.fc"]
    assert all(d.rows == 7 for d in diffs)
    assert first_divergence(diffs) == (None, None)


def test_perturbed_rmsnorm_epsilon_is_named_as_local_origin():
    torch.manual_seed(0)
    a = Toy()
    b = copy.deepcopy(a)
    b.layers[1].norm.eps = 1e-2
    x = torch.randn(5, 2, 16)
    diffs = compare_ops(_run_full(a, x).ordered(), _run_incremental(b, x).ordered())
    op, origin = first_divergence(diffs)
    assert op.name == "layers.1.norm" and origin == "local"
    later = {d.name: d for d in diffs}["layers.2.norm"]
    assert later.differs and later.input_max_abs > 0


def test_uncaptured_upstream_change_is_reported_as_propagated():
    torch.manual_seed(0)
    a = Toy()
    b = copy.deepcopy(a)
    b.shift = 1e-3
    x = torch.randn(5, 2, 16)
    op, origin = first_divergence(compare_ops(_run_full(a, x).ordered(), _run_full(b, x).ordered()))
    assert op.name == "layers.2.norm" and origin == "propagated"


def test_logprob_gap_statistics():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]], dtype=torch.float64)
    b = a.clone()
    b[0, 1] += 1e-9
    b[1, 0] += 1e-3
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = logprob_gap(a, b, mask)
    assert s["tokens_compared"] == 5
    assert abs(s["max_abs_logp_gap"] - 1e-3) < TOLERANCES["fp64_logp_metrics"][0]
    assert s["histogram"]["0"] == 3 and sum(s["histogram"].values()) == 5
