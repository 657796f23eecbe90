"""A gradient's amax taken by the pass that wrote it (minite.ops.common.hint_amax): the experts' SwiGLU backward for
FC1's dgrad operand, the combine's backward for FC2's. The dgrad quantisation takes the hint instead of an amax pass
of its own, and every gradient keeps its bits."""
import pytest
import torch

from minite.nvfp4 import NVFP4Recipe, recipe as recipe_module
from minite.ops import combine_for_training, nvfp4_grouped_linear
from minite.ops.common import abs_max, hint_amax, hinted_amax, lazy_abs_max

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Catch(torch.autograd.Function):
    """Identity whose backward keeps the gradient object it receives (what the next op's backward would get)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Catch.seen.append(g)
        return g


def test_a_hint_holds_until_its_tensor_is_written():
    t = torch.randn(4, 32, device=DEVICE)
    assert hinted_amax(t) is None
    hint_amax(t, abs_max(t))
    assert torch.equal(hinted_amax(t), t.abs().amax())
    assert hinted_amax(t.t()) is None and hinted_amax(t.clone()) is None  # other tensors: no hint
    t.mul_(2.0)  # an in-place write: the hint is stale
    assert hinted_amax(t) is None
    calls = []
    hint_amax(t, lambda: calls.append(1) or abs_max(t))  # computed once, when asked
    assert not calls
    assert torch.equal(hinted_amax(t), t.abs().amax()) and torch.equal(hinted_amax(t), t.abs().amax())
    assert calls == [1]
    source, u = torch.randn(3, 32, device=DEVICE), torch.randn(5, 32, device=DEVICE)
    hint_amax(u, lazy_abs_max(source))
    source.add_(1.0)  # what the function would read was written: no hint
    assert hinted_amax(u) is None
    hint_amax(u, lazy_abs_max(source))
    assert torch.equal(hinted_amax(u), source.abs().amax())


@pytest.mark.parametrize("values", ["random", "negative zeros", "nan", "inf"])
def test_abs_max_is_the_quantisers_amax(values):
    """abs_max (one aminmax) gives max |t| bit for bit, +0 for -0 everywhere, NaN for a NaN, inf for -inf."""
    t = torch.randn(33, 16, device=DEVICE).bfloat16()
    if values == "negative zeros":
        t = -torch.zeros_like(t)
    elif values == "nan":
        t[5, 3] = float("nan")
    elif values == "inf":
        t[7, 1] = float("-inf")
    got = abs_max(t)
    assert got.dtype == torch.float32 and got.shape == ()
    if values == "nan":
        assert bool(got.isnan())
    else:
        assert torch.equal(got.view(torch.int32), t.float().abs().amax().view(torch.int32))
    assert int(abs_max(t[:0]).view(torch.int32)) == 0


@pytest.mark.parametrize("values", ["random", "negative zeros", "nan", "inf", "strided", "empty"])
def test_the_amax_kernel_is_torchs_amax(values):
    """kernels/nvfp4_quant.py `amax_triton` (what abs_max takes on a GPU): max |x| bit for bit, over a transposed
    or a strided view too, +0 for -0 everywhere and for an empty x, NaN for one NaN among finite values."""
    from minite.kernels.nvfp4_quant import amax_triton

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 70, generator=g) * torch.logspace(-3, 3, 70)).bfloat16().to(DEVICE)
    if values == "negative zeros":
        x = -torch.zeros_like(x)
    elif values == "nan":
        x[123, 45] = float("nan")
    elif values == "inf":
        x[7, 1] = float("-inf")
    elif values == "strided":
        x = x[::3, 5:60].t()
    elif values == "empty":
        x = x[:0]
    got = amax_triton(x)
    assert got.shape == () and got.dtype == torch.float32
    if values == "nan":
        assert bool(got.isnan())
    else:
        want = x.float().abs().amax() if x.numel() else torch.zeros((), device=DEVICE)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        amax_triton(x.reshape(-1))


@pytest.mark.parametrize("deterministic", [False, True])
def test_combine_for_training_is_upstreams_combine(deterministic):
    """Forward and the rows' gradient bitwise upstream's unpermute (scatter_add / index_add_ into zeros, autograd's
    gather); the gradient carries max |gradient| as its hint (every token has k rows)."""
    tokens, k, hidden = 11, 3, 32
    g = torch.Generator().manual_seed(0)
    row_token = torch.randperm(tokens * k, generator=g) % tokens
    # small integers: every order of the sums (a GPU's atomics) gives the same bits
    rows = torch.randint(-8, 9, (tokens * k, hidden), generator=g).bfloat16().to(DEVICE)
    row_token = row_token.to(DEVICE)
    d_out = torch.randn(tokens, hidden, generator=g).bfloat16().to(DEVICE)

    up = rows.clone().requires_grad_()
    out = torch.zeros(tokens, hidden, dtype=rows.dtype, device=DEVICE)
    if deterministic:
        out = out.index_add(0, row_token, up)
    else:
        out = out.scatter_add(0, row_token.unsqueeze(1).expand(-1, hidden), up)
    out.backward(d_out)

    mine = rows.clone().requires_grad_()
    _Catch.seen = []
    got = combine_for_training(_Catch.apply(mine), row_token, tokens, deterministic=deterministic)
    assert torch.equal(got.view(torch.int16), out.detach().view(torch.int16))
    got.backward(d_out)
    assert torch.equal(mine.grad.view(torch.int16), up.grad.view(torch.int16))
    (grad,) = _Catch.seen
    assert torch.equal(hinted_amax(grad).view(torch.int32), grad.float().abs().amax().view(torch.int32))


def _spy_global_amax(monkeypatch):
    seen = []
    real = recipe_module.quantize

    def spy(*args, **kwargs):
        seen.append(kwargs.get("global_amax"))
        return real(*args, **kwargs)

    monkeypatch.setattr(recipe_module, "quantize", spy)
    return seen


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_grouped_dgrad_takes_the_hint(monkeypatch, backend):
    """The grouped linear's dgrad quantises its gradient with the hinted amax: the same dx as without a hint, and
    a different dx with a wrong hint (the hint is what it used)."""
    counts = [10, 0, 17, 21]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 64, generator=g).to(DEVICE)
    w = torch.randn(4, 48, 64, generator=g).to(DEVICE)
    dy = torch.randn(sum(counts), 48, generator=g).to(DEVICE)

    def dx(hint):
        xx = x.clone().requires_grad_()
        y = _Catch.apply(nvfp4_grouped_linear(xx, w, counts, NVFP4Recipe(), seed=3, backend=backend))
        grad = dy.clone()
        if hint is not None:
            hint_amax(grad, hint)
        y.backward(grad)
        return xx.grad

    seen = _spy_global_amax(monkeypatch)
    plain = dx(None)
    assert seen and all(a is None for a in seen)
    seen.clear()
    hinted = dx(dy.abs().amax())
    assert any(a is not None for a in seen)
    assert torch.equal(hinted, plain)
    assert not torch.equal(dx(dy.abs().amax() * 3), plain)  # (a power of two would give the same values)


def test_experts_take_both_hints_with_the_same_gradients(monkeypatch):
    """The SwiGLU experts and the combine on the kernels (on the CPU the interpreter, routed as on a GPU), NVFP4 FC1
    and FC2: with the hints both dgrads take a given amax, and every gradient is bitwise that of the run without
    them (deterministic algorithms: on a GPU the index_add of x's gradient otherwise adds in the atomics' order)."""
    from minite.ops import swiglu_experts
    from minite.strict import fused

    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {"expert_swiglu", "expert_swiglu_amax"})
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _experts_with_and_without_hints(monkeypatch, swiglu_experts)
    finally:
        torch.use_deterministic_algorithms(was)


def _experts_with_and_without_hints(monkeypatch, swiglu_experts):
    tokens, k, hidden, ffn, experts = 12, 2, 32, 48, 4
    g = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    from minite.ops import route
    row_token, row_prob, counts = route(ids, torch.rand(tokens, k, generator=g), experts)
    row_token, row_prob = row_token.to(DEVICE), row_prob.to(DEVICE)
    x = torch.randn(tokens, hidden, generator=g).bfloat16().to(DEVICE)
    w1 = (torch.randn(experts, 2 * ffn, hidden, generator=g) / 4).bfloat16().to(DEVICE)
    w2 = (torch.randn(experts, hidden, ffn, generator=g) / 4).bfloat16().to(DEVICE)
    d_out = torch.randn(tokens, hidden, generator=g).bfloat16().to(DEVICE)
    counts = counts.tolist()

    def run(hints):
        xx, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        fc = lambda h, i: nvfp4_grouped_linear(h, (a, b)[i], counts, NVFP4Recipe(), seed=5 + i,  # noqa: E731
                                               backend="triton")
        rows = swiglu_experts(xx.index_select(0, row_token), row_prob, fc, strict=False, amax_hint=hints)
        if hints:
            out = combine_for_training(rows, row_token, tokens, deterministic=True)
        else:
            out = torch.zeros(tokens, hidden, dtype=rows.dtype, device=DEVICE).index_add(0, row_token, rows)
        out.backward(d_out)
        return xx.grad, a.grad, b.grad

    seen = _spy_global_amax(monkeypatch)
    plain = run(False)
    assert all(a is None for a in seen)
    seen.clear()
    hinted = run(True)
    assert sum(a is not None for a in seen) == 2  # FC2's dgrad and FC1's
    for p, h in zip(plain, hinted):
        assert torch.equal(p.view(torch.int16), h.view(torch.int16))
