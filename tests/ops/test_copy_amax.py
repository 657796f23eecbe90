"""The expert weights' master -> weight copy with their amax (minite.kernels.copy_amax, interpreted on a CPU): the
bf16 weight is bitwise torch's copy_, the amax bitwise stack_amax of that weight, on random and boundary values, and
a stack quantised with that amax equals one quantised without it in every field. The learner's use of it is
tests/learner/test_weight_copy.py."""
import pytest
import torch

import minite.kernels  # noqa: F401  registers copy_amax and the quantisation kernels
from minite.nvfp4 import NVFP4Recipe
from minite.nvfp4.backend import kernel
from minite.nvfp4.grouped import quantize_stack, stack_amax
from minite.ops import quantize_expert_weights


def _bits32(x):
    return x.view(torch.int32)


def _from_bits(bits, shape):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(shape)


def _boundary_master() -> torch.Tensor:
    """fp32 [6, 16, 32] of the cases bf16 rounding and the amax can get wrong, one kind per expert."""
    g = torch.Generator().manual_seed(1)
    low = torch.randint(0, 1 << 16, (16 * 32,), generator=g)
    # expert 0: ties (low half exactly 0x8000) on odd and even kept bits, and their neighbours, both signs
    hi = torch.randint(0x3000, 0x4800, (16 * 32,), generator=g)
    e0 = (hi << 16) | torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000])[torch.arange(16 * 32) % 4]
    e0 = torch.where(torch.arange(16 * 32) % 3 == 0, e0 | (1 << 31), e0)
    # expert 1: near bf16's largest finite value 0x7F7F (0x7F7F8000 is a tie that rounds up to Inf), fp32 max
    e1 = torch.tensor([0x7F7F7FFF, 0x7F7F8000, 0x7F7F0000, 0x7F7FFFFF, 0x7F7E8000, 0x7F7E8001])
    e1 = torch.cat([e1, (0x7F000000 | low[:16 * 32 - 6])]) | ((torch.arange(16 * 32) % 2) << 31)
    # expert 2: fp32 subnormals (bf16 keeps them: the same exponent range) and the smallest normals, both signs
    e2 = torch.randint(1, 0x00810000, (16 * 32,), generator=g) | ((torch.arange(16 * 32) % 2) << 31)
    # expert 3: zeros and -0 only (the amax is +0); expert 4: -0 and tiny negatives; expert 5: +-Inf among normals
    e3 = torch.where(torch.arange(16 * 32) % 2 == 0, 0, 1 << 31)
    e4 = torch.where(torch.arange(16 * 32) % 5 == 0, (1 << 31) | 3, 1 << 31)
    e5 = (torch.randint(0x3F000000, 0x40000000, (16 * 32,), generator=g) | ((torch.arange(16 * 32) % 2) << 31))
    e5[7], e5[100] = 0x7F800000, 0xFF800000
    return _from_bits(torch.stack([e0, e1, e2, e3, e4, e5]).tolist(), (6, 16, 32))


def _master_cases():
    torch.manual_seed(0)
    scales = torch.tensor([1e-30, 1e-3, 1.0, 3e4, 1e30])[:, None, None]
    yield "random", torch.randn(5, 48, 64) * scales
    yield "boundary", _boundary_master()
    yield "several programs per expert", torch.randn(2, 130, 300)  # 39000 > BLOCK * ITERS elements per expert
    yield "one expert, ragged", torch.randn(1, 3, 7)


@pytest.mark.parametrize("name,master", list(_master_cases()), ids=[c[0] for c in _master_cases()])
def test_copy_is_torch_copy_and_amax_is_stack_amax(name, master):
    weight = torch.full(master.shape, 7.0, dtype=torch.bfloat16)
    amax = kernel("copy_amax")(master, weight)
    assert torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16)), name
    assert amax.dtype == torch.float32 and amax.shape == (master.shape[0],)
    assert torch.equal(_bits32(amax), _bits32(stack_amax(weight))), name


def test_boundary_cases_are_there():
    """The boundary master holds what it says: ties that round up to Inf, subnormals kept, an all -0 expert."""
    m = _boundary_master()
    w = m.to(torch.bfloat16)
    assert torch.isinf(w[1]).any() and torch.isfinite(m[1]).all()
    assert (w[2] != 0).any() and (w[2].float().abs() < torch.finfo(torch.float32).tiny).any()
    assert torch.equal(_bits32(stack_amax(w))[3:5], torch.zeros(2, dtype=torch.int32))
    assert torch.isinf(stack_amax(w)[5])


def test_nan_gives_nan():
    """A NaN copies as a NaN (its bits are unspecified: torch's own CPU copy writes 0x7FC0 or 0xFFFF) and makes its
    expert's amax a NaN, as stack_amax does; the other experts are unchanged."""
    master = torch.randn(3, 16, 32)
    master[1, 3, 5] = float("nan")
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    amax = kernel("copy_amax")(master, weight)
    ref = master.to(torch.bfloat16)
    assert torch.equal(torch.isnan(weight), torch.isnan(master))
    finite = ~torch.isnan(master)
    assert torch.equal(weight[finite].view(torch.int16), ref[finite].view(torch.int16))
    assert torch.isnan(amax[1]) and torch.isnan(stack_amax(weight)[1])
    assert torch.equal(_bits32(amax[[0, 2]]), _bits32(stack_amax(weight)[[0, 2]]))


def test_empty_and_refused_inputs():
    assert kernel("copy_amax")(torch.zeros(3, 0, 16), torch.zeros(3, 0, 16, dtype=torch.bfloat16)).tolist() == [0.0] * 3
    assert kernel("copy_amax")(torch.zeros(0, 4, 16), torch.zeros(0, 4, 16, dtype=torch.bfloat16)).numel() == 0
    with pytest.raises(ValueError, match="fp32 source and a bf16 destination"):
        kernel("copy_amax")(torch.zeros(2, 4, 16), torch.zeros(2, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        kernel("copy_amax")(torch.zeros(2, 16, 4).transpose(1, 2), torch.zeros(2, 4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("values", [True, False])
def test_stack_quantised_with_the_copied_amax_is_the_same(values):
    """quantize_stack / quantize_expert_weights with the copy's amax: every field bitwise as without it."""
    torch.manual_seed(2)
    master = torch.randn(4, 32, 128) * torch.tensor([1e-4, 1.0, 10.0, 0.0])[:, None, None]
    master[3, 0, 0] = -0.0
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    amax = kernel("copy_amax")(master, weight)
    a = quantize_stack(weight, values=values, backend="triton")
    b = quantize_stack(weight, values=values, backend="triton", amax=amax)
    for f in ("data", "scale", "global_scale", "values", "amax"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f
    recipe = NVFP4Recipe()
    c = quantize_expert_weights(weight, recipe, backend="triton", values=values, amax=amax)
    d = quantize_expert_weights(weight, recipe, backend="triton", values=values)
    assert torch.equal(c.scale.view(torch.uint8), d.scale.view(torch.uint8)) and torch.equal(c.amax, d.amax)
    assert torch.equal(c.global_scale, d.global_scale)


def test_a_given_amax_is_checked_and_used():
    """The amax is used as given (an amax of 2x the true one halves the global decode scale's inverse), and one of
    the wrong shape, dtype or device is refused."""
    w = torch.randn(2, 16, 32).bfloat16()
    true = stack_amax(w)
    assert not torch.equal(quantize_stack(w, backend="triton", amax=true * 2).global_scale,
                           quantize_stack(w, backend="triton").global_scale)
    with pytest.raises(ValueError, match="amax must be fp32"):
        quantize_stack(w, backend="triton", amax=true[:1])
    with pytest.raises(ValueError, match="amax must be fp32"):
        quantize_stack(w, backend="triton", amax=true.double())
    # the reference computes its own (the same value): a given amax changes nothing there
    r = quantize_stack(w, backend="reference", amax=true * 2)
    assert torch.equal(r.global_scale, quantize_stack(w, backend="reference").global_scale)
