"""minite.ops: the NVFP4 linear / grouped linear are exactly the recipe's quantised GEMMs (atol=0), their
stochastic rounding is reproducible from the seed, the TP amax sync reproduces the unsharded quantisation
exactly, and the result stays within the NVFP4 error of the high-precision product (tolerances.py)."""
import pytest
import torch

from minite.nvfp4 import NVFP4Recipe, apply_rht, gemm
from minite.ops import (derive_seed, nvfp4_grouped_linear, nvfp4_grouped_linear_forward, nvfp4_linear,
                        nvfp4_linear_forward, quantize_weight)
from minite.ops import common
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

R = NVFP4Recipe()


def _data(m=37, k=64, n=48, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, dy


def _wgrad_reference(dy, x, seed):
    pad = (-x.shape[0]) % 16
    # in the operands' own dtype: the RHT rounds its output to it (bf16 here), as TE does (docs/nvfp4.md)
    dyt = torch.cat([dy, dy.new_zeros(pad, dy.shape[1])]).t().contiguous()
    xt = torch.cat([x, x.new_zeros(pad, x.shape[1])]).t().contiguous()
    gq = R.wgrad_gradient.quantize(dyt, seed=derive_seed(seed, 2))
    xq = R.wgrad_input.quantize(xt, seed=derive_seed(seed, 3))
    return gemm(gq, xq)


def test_linear_is_the_recipe_gemms_exactly():
    x, w, dy = _data()
    y = nvfp4_linear(x, w, R, seed=5)
    wq = R.weight.quantize(w.detach())
    assert torch.equal(y, gemm(R.activation.quantize(x.detach()), wq).to(x.dtype))
    y.backward(dy)
    dx = gemm(R.gradient.quantize(dy, seed=derive_seed(5, 1)), wq.t()).to(x.dtype)
    assert torch.equal(x.grad, dx)
    assert torch.equal(w.grad, _wgrad_reference(dy, x.detach(), 5).to(w.dtype))


def test_forward_only_matches_autograd_path():
    x, w, _ = _data(m=5)
    with torch.no_grad():
        y = nvfp4_linear_forward(x.reshape(1, 5, -1), quantize_weight(w, R), R)
        stack = torch.stack([w, 2 * w])
        yg = nvfp4_grouped_linear_forward(x, [quantize_weight(m, R) for m in stack], [2, 3], R)
    assert torch.equal(y.reshape(5, -1), nvfp4_linear(x, w, R))
    assert torch.equal(yg, nvfp4_grouped_linear(x, stack, [2, 3], R))


def test_rounding_seeds_are_reproducible():
    grads = []
    for seed in (3, 3, 4):
        x, w, dy = _data()
        nvfp4_linear(x, w, R, seed=seed).backward(dy)
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert not torch.equal(grads[0][0], grads[2][0]) and not torch.equal(grads[0][1], grads[2][1])
    assert derive_seed(1, 2) != derive_seed(2, 1) and 0 <= derive_seed(2**40, 7) < 2**32


def test_derive_seeds_is_derive_seed_elementwise():
    import numpy as np

    from minite.ops.common import derive_seeds
    g = np.random.default_rng(0)
    big = g.integers(0, 2**62, 50)
    for parts in [(7, np.arange(1000, 1128)), (big, 2), (-3, big, 5), (2**40, np.array([0, 1, 2**31])),
                  (2**64 - 5, np.arange(3)), (2**63 + 1, 2**70 + 3, np.arange(2))]:
        got = derive_seeds(*parts)
        shape = np.broadcast_shapes(*(np.shape(p) for p in parts))
        want = [derive_seed(*(int(np.broadcast_to(p, shape)[i]) for p in parts)) for i in range(shape[0])]
        assert got.tolist() == want
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scalars only: no overflow warning from the wrapping arithmetic
        assert int(derive_seeds(2**63 + 7, 12345)) == derive_seed(2**63 + 7, 12345)


def test_seed_mixes_is_seed_mix_elementwise():
    from minite.kernels.nvfp4_seeds import _as_int32_bits, seed_mix, seed_mixes
    seeds = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 123456789, -1]
    assert seed_mixes(seeds).tolist() == [_as_int32_bits(seed_mix(s)) for s in seeds]
    assert seed_mixes(torch.tensor(seeds)).tolist() == seed_mixes(seeds).tolist()


def test_grouped_equals_per_expert_linears():
    """Per-row activation scales make a token's forward independent of its group: rows equal nvfp4_linear's."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 32, 64, generator=g) * 0.1).requires_grad_()
    x = torch.randn(21, 64, generator=g).requires_grad_()
    counts = [9, 0, 12]
    y = nvfp4_grouped_linear(x, w, counts, R, seed=2)
    assert torch.equal(y[:9], nvfp4_linear(x[:9], w[0], R)) and torch.equal(y[9:], nvfp4_linear(x[9:], w[2], R))
    y.backward(torch.ones_like(y))
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # an expert with no token gets a zero gradient
    assert torch.equal(w.grad[2], _wgrad_reference(torch.ones(12, 32), x.detach()[9:], derive_seed(2, 1002)))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        nvfp4_grouped_linear(x, w, [9, 12], R)


def test_empty_expert_batch():
    w = torch.randn(2, 16, 32, requires_grad=True)
    x = torch.zeros(0, 32, requires_grad=True)
    y = nvfp4_grouped_linear(x, w, [0, 0], R)
    (y.sum() + 0 * w.sum()).backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_empty_token_batch_dense_linear():
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.zeros(2, 0, 32, requires_grad=True)
    y = nvfp4_linear(x, w, R, seed=1)
    (y.sum() + 0 * w.sum()).backward()
    assert y.shape == (2, 0, 16) and torch.equal(w.grad, torch.zeros_like(w)) and x.grad.shape == x.shape


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("role,shard", [("weight", "rows"), ("activation", "cols"), ("wgrad_input", "rows"),
                                        ("gradient", "cols")])
def test_tp_amax_sync_reproduces_unsharded_quantisation(monkeypatch, role, shard, backend):
    """A shard quantised with the group amax equals the same slice of the unsharded tensor, bit for bit."""
    op = getattr(R, role)
    full = (torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)  # triton: on the GPU there
    seen = apply_rht(full) if op.rht else full
    amax = seen.abs().amax(dim=1) if op.scale_scope == "row" else seen.abs().amax()
    monkeypatch.setattr(common, "group_size", lambda group: 2)
    monkeypatch.setattr(common, "group_amax", lambda values, dim, group: amax)
    part = full[16:] if shard == "rows" else full[:, 32:]
    got = common.quantize_scoped(part.contiguous(), op, seed=None if op.rounding == "nearest" else 1, backend=backend,
                               amax_group="fake")
    want = op.quantize(full, seed=1)
    if shard == "rows":
        br = op.block[0]
        assert torch.equal(got.data, want.data[16:]) and torch.equal(got.scale.view(torch.uint8),
                                                                     want.scale[16 // br:].view(torch.uint8))
    else:
        scale_eq = torch.equal(got.scale.view(torch.uint8), want.scale[:, 2:].view(torch.uint8))
        assert scale_eq and torch.equal(got.global_scale, want.global_scale)
        if op.rounding == "nearest":  # stochastic draws are indexed by local position: only the scales must match
            assert torch.equal(got.data, want.data[:, 16:])


def test_nvfp4_linear_close_to_high_precision():
    x, w, dy = _data(m=64, k=128, n=64, dtype=torch.float32)
    y = nvfp4_linear(x, w, R, seed=0)
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = xr @ wr.t()
    yr.backward(dy)
    _, rtol = TOLERANCES["nvfp4_linear_vs_fp32"]
    for got, ref in ((y, yr), (x.grad, xr.grad), (w.grad, wr.grad)):
        assert float((got - ref).detach().norm() / ref.norm()) < rtol


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="do not match"):
        nvfp4_linear(torch.randn(4, 32), torch.randn(16, 48), R)
    with pytest.raises(ValueError, match="sharded"):
        nvfp4_linear(torch.randn(4, 32), torch.randn(16, 32), R, sharded="sideways")


def test_route_reads_nothing_back_and_groups_rows_as_megatron():
    """minite.ops.experts.route (the SGLang plugin's MoE rows): counts stay a device tensor, equal to bincount, with
    idle experts; rows expert-major and token-ascending inside an expert; no host read (a CUDA graph can capture it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minite.ops.experts import route

    class Reads(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.bincount.default,
                        torch.ops.aten.nonzero.default):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(5)])  # 5 tokens, top-3 of 12 experts
    w = torch.rand(5, 3, generator=g)
    with Reads() as reads:
        row_token, row_prob, counts = route(ids, w, 12)
    assert reads.ops == [] and torch.is_tensor(counts)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=12).tolist() and 0 in counts.tolist()
    experts = ids.reshape(-1)[torch.sort(ids.reshape(-1), stable=True).indices]
    pairs = list(zip(experts.tolist(), row_token.tolist()))
    assert pairs == sorted(pairs)  # by expert, then by token
    assert all(ids[t].tolist().count(e) == 1 for e, t in pairs)
    assert torch.equal(row_prob, torch.stack([w[t, ids[t].tolist().index(e)] for e, t in pairs]).float())
