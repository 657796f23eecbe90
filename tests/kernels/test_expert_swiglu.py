"""The experts' SwiGLU on the kernels (kernels/expert_swiglu.py), forward and backward: bitwise the formulas of its
docstring (torch's ops in torch's order) with the interpreter's exp on the CPU, and bitwise torch's own ops and
autograd on the GPU (marker gpu: the test that lets `minite.ops.swiglu` route there)."""
import numpy as np
import pytest
import torch

from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, f, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * f, generator=g) * 4).bfloat16()
    edge = torch.tensor([0.0, -0.0, 88.0, -100.0, 1e-40, -1.28, 3e38, -3e38])[: min(8, f)]
    h[0, : len(edge)] = edge  # zeros, exp's overflow and underflow, a bf16 subnormal, the silu' zero, bf16 max-ish
    h[0, f: f + len(edge)] = edge.flip(0)
    if rows > 4:  # gates whose sigmoid 1 / (1 + e^-g) is an fp32 subnormal (g in (-88.7, -87.3)): no flush to zero
        low = torch.tensor([-87.5, -88.0, -88.5])[: f]
        h[4, : len(low)] = low
    probs = torch.rand(rows, generator=g)
    if rows > 1:
        probs[1] = 0.0
    if rows > 3:
        h[3] = 0.0
    da = (torch.randn(rows, f, generator=g) * 2).bfloat16()
    if rows > 2:
        da[2, 0] = 0.0
    return h.to(DEVICE), probs.to(DEVICE), da.to(DEVICE)


def _numpy_exp(x):  # the interpreter's exp: numpy's, in fp32
    return torch.from_numpy(np.exp(x.cpu().numpy())).to(x.device)


def _reference(h, probs, da, exp):
    """The module docstring's formulas in torch ops with `exp`: (a, dh, dprobs)."""
    f = h.shape[1] // 2
    g, u = h[:, :f].float(), h[:, f:].float()
    e = exp(-g)
    silu = g / (1.0 + e)
    s = 1.0 / (1.0 + e)
    a = (silu * u * probs[:, None]).bfloat16()
    t = da.float() * probs[:, None]
    dh = torch.cat([((t * u) * s * (1.0 + g * (1.0 - s))).bfloat16(), (t * silu).bfloat16()], dim=1)
    return a, dh, (da.float() * (silu * u)).sum(dim=1)


def _bits_equal(x, y):
    return x.shape == y.shape and torch.equal(x.view(torch.int16), y.view(torch.int16))


def _row_sum_close(got, terms_abs_sum, want):
    """Equal where the sums are not finite (NaN where NaN, the same infinity), within the rounding of two orders of
    the same fp32 sum elsewhere."""
    atol, _ = TOLERANCES["expert_swiglu_dprobs_row_sum"]
    finite = torch.isfinite(want) & torch.isfinite(terms_abs_sum)
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    assert torch.equal(got[~finite].nan_to_num(0.0), want[~finite].nan_to_num(0.0))
    gap = (got[finite] - want[finite]).abs()
    assert bool((gap <= atol * terms_abs_sum[finite]).all()), gap.max()


SHAPES = ((7, 48), (33, 768), (1, 16), (5, 24), (1, 1))


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reference uses numpy's exp, the interpreter's")
@pytest.mark.parametrize("rows,f", SHAPES)
def test_forward_and_backward_are_the_formulas_bit_for_bit(rows, f):
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton

    h, probs, da = _inputs(rows, f, rows * 100 + f)
    a_ref, dh_ref, dp_ref = _reference(h, probs, da, _numpy_exp)
    assert _bits_equal(expert_swiglu_triton(h, probs), a_ref)
    dh, dp = expert_swiglu_backward_triton(h, probs, da)
    assert _bits_equal(dh, dh_ref)
    g, u = h[:, :f].float(), h[:, f:].float()
    terms = (da.float() * (g / (1.0 + _numpy_exp(-g)) * u)).abs().sum(dim=1)
    _row_sum_close(dp, terms, dp_ref)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU reference uses numpy's exp, the interpreter's")
def test_forward_products_round_in_torchs_order():
    """(silu * u) * p against silu * (u * p): a one-ulp fp32 difference flips the bf16 rounding of ~1 element in
    2^16, so this takes enough of them (~30 expected flips) to see the order."""
    from minite.kernels.expert_swiglu import expert_swiglu_triton

    h, probs, da = _inputs(2048, 1024, 5)
    a_ref, _, _ = _reference(h, probs, da, _numpy_exp)
    assert _bits_equal(expert_swiglu_triton(h, probs), a_ref)


def test_the_formulas_are_torchs_autograd():
    """The reference above, with torch's exp, against torch's own ops and autograd (`minite.ops.swiglu`, default
    mode) on this device: the forward's bits, dh within one bf16 step where torch's silu and silu_backward take
    another exp path (a few elements in 10^5 on the CPU; none allowed on the GPU, below), dprobs within the row sums'
    rounding."""
    from minite.ops import swiglu

    h, probs, da = _inputs(257, 768, 0)
    hr, pr = h.clone().requires_grad_(), probs.clone().requires_grad_()
    a = swiglu(hr, pr, strict=False)
    a.backward(da)
    a_ref, dh_ref, dp_ref = _reference(h, probs, da, torch.exp)
    assert _bits_equal(a, a_ref)
    finite = torch.isfinite(dh_ref) & torch.isfinite(hr.grad)
    assert bool((torch.isfinite(dh_ref) == torch.isfinite(hr.grad)).all())
    _, rtol = TOLERANCES["swiglu_kernel_vs_torch_bf16"]
    step = (dh_ref[finite].float() - hr.grad[finite].float()).abs()
    assert bool((step <= rtol * hr.grad[finite].float().abs()).all())
    assert int((dh_ref != hr.grad)[finite].sum()) <= dh_ref.numel() // 10_000
    g, u = h[:, :768].float(), h[:, 768:].float()
    terms = (da.float() * (g / (1.0 + torch.exp(-g)) * u)).abs().sum(dim=1)
    _row_sum_close(pr.grad, terms, dp_ref)


def test_nan_and_inf_propagate():
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton

    h, probs, da = _inputs(4, 32, 7)
    h[1, 3] = float("nan")  # a gate
    h[2, 32 + 5] = float("inf")  # an up value
    a = expert_swiglu_triton(h, probs)
    assert bool(a[1, 3].isnan()) and bool(a[2, 5].isinf())
    dh, dp = expert_swiglu_backward_triton(h, probs, da)
    assert bool(dh[1, 3].isnan()) and bool(dp[1].isnan()) and not bool(torch.isfinite(dp[2]))
    assert bool(torch.isfinite(dh[3]).all()) and float(dp[3]) == 0.0  # the all-zero row


def _amax_bits(dh):
    """max |dh| as fp32 bits (int32): torch's amax, NaN where dh holds one."""
    return dh.float().abs().amax().view(torch.int32) if dh.numel() else torch.tensor(0, dtype=torch.int32)


def _same_amax(amax, dh):
    """amax is max |dh|: bitwise, or NaN where torch's is (a NaN's bits are not specified: CUDA's max gives its
    canonical NaN, the kernel the stored bf16 NaN)."""
    want = _amax_bits(dh).view(torch.float32).cpu()
    if bool(want.isnan()):
        return bool(amax.isnan())
    return torch.equal(amax.view(torch.int32).cpu(), want.view(torch.int32))


@pytest.mark.parametrize("rows,f", SHAPES + ((40, 768),))
def test_backward_amax_is_the_amax_of_dh(rows, f):
    """amax=True: dh and dprobs bitwise those without it, and the amax bitwise max |dh| (the pass that FC1's dgrad
    operand would otherwise take), at partial tiles, an empty dh, Inf, and -0 everywhere (+0: the quantiser's
    abs)."""
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton

    h, probs, da = _inputs(rows, f, rows + f)
    dh, dp = expert_swiglu_backward_triton(h, probs, da)
    dh2, dp2, amax = expert_swiglu_backward_triton(h, probs, da, amax=True)
    assert _bits_equal(dh2, dh) and torch.equal(dp2.view(torch.int32), dp.view(torch.int32))
    assert amax.shape == () and amax.dtype == torch.float32 and amax.device == dh.device
    assert _same_amax(amax, dh)
    zero, minus = torch.zeros_like(da), -torch.zeros_like(probs)  # t = da * p = -0: dh = -0 or +0 everywhere
    dh0, _, amax0 = expert_swiglu_backward_triton(h, minus, zero, amax=True)
    assert int(amax0.view(torch.int32)) == 0 and _same_amax(amax0, dh0)
    big = da.clone()
    big[0, 0] = float("inf")
    dhi, _, amaxi = expert_swiglu_backward_triton(h, probs, big, amax=True)
    assert _same_amax(amaxi, dhi)
    empty = expert_swiglu_backward_triton(h[:0], probs[:0], da[:0], amax=True)
    assert empty[0].shape == (0, 2 * f) and int(empty[2].view(torch.int32)) == 0


def test_backward_amax_is_nan_where_dh_holds_a_nan():
    """One NaN in dh (not a whole tile of them) makes the amax NaN, as torch's amax and the reference quantiser's:
    the NaN is not lost in the quantisation that takes this amax."""
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton

    h, probs, da = _inputs(40, 768, 9)
    da[17, 300] = float("nan")
    dh, _, amax = expert_swiglu_backward_triton(h, probs, da, amax=True)
    assert int(dh.isnan().sum()) == 2 and bool(amax.isnan())


def test_refuses_bad_input():
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton

    h, probs, da = _inputs(4, 16, 0)
    with pytest.raises(ValueError, match="expert_swiglu needs h bf16"):
        expert_swiglu_triton(h.float(), probs)
    with pytest.raises(ValueError, match="expert_swiglu needs h bf16"):
        expert_swiglu_triton(h, probs[:3])
    with pytest.raises(ValueError, match="da of shape"):
        expert_swiglu_backward_triton(h, probs, da[:, :8])


def test_ops_swiglu_routes_to_the_kernels_once_proven(monkeypatch):
    """`minite.ops.swiglu` takes the kernels only with "expert_swiglu" in fused.PROVEN (and a GPU tensor: routed here
    as if the CPU one were); then its forward and backward are the kernels' (the same bits as calling them)."""
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton
    from minite.ops import experts
    from minite.strict import fused

    h, probs, da = _inputs(9, 48, 3)
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    assert "expert_swiglu" in fused.PROVEN  # as shipped since its GPU test passed (2026-12-05)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"expert_swiglu"})
    assert not experts.swiglu_kernels_apply(h, probs)  # not proven
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {"expert_swiglu"})
    assert experts.swiglu_kernels_apply(h, probs)
    assert not experts.swiglu_kernels_apply(h, probs.double())  # fp32 probs only
    hr, pr = h.clone().requires_grad_(), probs.clone().requires_grad_()
    a = experts.swiglu(hr, pr, strict=False)
    assert a.grad_fn is not None and "SwiGLUKernels" in type(a.grad_fn).__name__
    a.backward(da)
    dh, dp = expert_swiglu_backward_triton(h, probs, da)
    assert _bits_equal(a.detach(), expert_swiglu_triton(h, probs))
    assert _bits_equal(hr.grad, dh) and torch.equal(pr.grad, dp)
    assert experts.swiglu(hr, pr, strict=True).grad_fn is not None  # strict mode keeps its own ops
    assert "SwiGLUKernels" not in type(experts.swiglu(hr, pr, strict=True).grad_fn).__name__


@pytest.mark.gpu
def test_kernels_are_torchs_ops_and_autograd_on_the_gpu():
    """On the GPU: the forward bitwise torch's ops (`minite.ops.swiglu`'s torch path), dh bitwise torch autograd's,
    dprobs within the row sums' rounding, the backward's amax bitwise torch's max |dh|; at a decode step's rows, a
    micro-batch's and odd sizes. It passed on sm_90 (an H100, 2026-12-05; before the amax), and "expert_swiglu"
    joined fused.PROVEN."""
    from minite.kernels.expert_swiglu import expert_swiglu_backward_triton, expert_swiglu_triton
    from minite.ops import experts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for rows, f, seed in ((64, 768, 1), (32768, 768, 2), (333, 48, 3), (1, 16, 4)):
        h, probs, da = _inputs(rows, f, seed)
        hr, pr = h.clone().requires_grad_(), probs.clone().requires_grad_()
        gate, up = torch.chunk(hr, 2, dim=-1)  # the torch path of ops.experts.swiglu, whatever routing says
        a = (torch.nn.functional.silu(gate.float()) * up.float() * pr.unsqueeze(-1).float()).to(hr.dtype)
        a.backward(da)
        assert _bits_equal(expert_swiglu_triton(h, probs), a.detach()), (rows, f)
        dh, dp = expert_swiglu_backward_triton(h, probs, da)
        assert _bits_equal(dh, hr.grad), (rows, f, int((dh != hr.grad).sum()))
        _, _, amax = expert_swiglu_backward_triton(h, probs, da, amax=True)  # the amax FC1's dgrad takes
        assert _same_amax(amax, hr.grad), (rows, f)
        g, u = h[:, :f].float(), h[:, f:].float()
        terms = (da.float() * (torch.nn.functional.silu(g) * u)).abs().sum(dim=1)
        _row_sum_close(dp, terms, pr.grad)
