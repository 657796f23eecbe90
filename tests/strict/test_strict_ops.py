"""Strict-mode ops (minite.strict.ops): exact batch invariance, and accuracy against torch.

Invariance checks are bitwise (torch.equal): a strict op's row must not depend on the other rows of the call, on
the number of keys past a query, or on the tensor's size (which moves elements between vector and scalar paths).
Accuracy checks compare with float64 torch: the fp64 polynomials must round to the correctly rounded fp32 value.
"""
import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.strict import ops as S
from tests.tolerances import TOLERANCES


def test_exp_is_correctly_rounded_fp32_and_handles_specials():
    x = torch.cat([torch.randn(50_000) * 30, torch.linspace(-110, 90, 20_001)])
    assert torch.equal(S.exp(x), torch.exp(x.double()).float())
    special = S.exp(torch.tensor([-math.inf, math.nan, 100.0, -200.0, 0.0]))
    assert special[0] == 0 and math.isnan(special[1]) and special[2] == math.inf and special[3] == 0
    assert special[4] == 1


def test_sincos_is_correctly_rounded_for_rope_angles():
    x = torch.rand(50_000) * 4096  # position * inverse frequency
    sin, cos = S.sincos(x)
    assert torch.equal(sin, torch.sin(x.double()).float())
    assert torch.equal(cos, torch.cos(x.double()).float())
    with pytest.raises(ValueError, match="2\\^20"):
        S.sincos(torch.tensor([2.0 ** 21]))


@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_elementwise_transcendentals_do_not_depend_on_tensor_size(n):
    """The same value at any index of any size of tensor (torch's own exp may not: vector body vs scalar tail)."""
    x = torch.randn(4096) * 5
    for f in (S.exp, S.silu, lambda t: S.sincos(t)[0]):
        big = f(x)
        assert torch.equal(f(x[:n]), big[:n])
        assert torch.equal(f(x[-n:]), big[-n:])


def test_tree_sum_ignores_trailing_zeros():
    a = torch.randn(6, 13)
    for pad in (1, 3, 19, 51):
        assert torch.equal(S.tree_sum(a), S.tree_sum(torch.cat([a, torch.zeros(6, pad)], dim=1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_do_not_depend_on_batch(dtype):
    x = torch.randn(37, 96).to(dtype)
    w = torch.randn(40, 96).to(dtype)
    full = S.linear(x, w)
    assert torch.equal(torch.cat([S.linear(x[i:i + 1], w) for i in range(37)]), full)
    assert torch.equal(S.linear(x[5:12], w), full[5:12])
    ref = x.double() @ w.double().t()
    rtol = TOLERANCES["strict_linear_vs_fp64"][1]
    assert (full.double() - ref).abs().max() <= rtol * ref.abs().max()  # pairwise fp32 sums


def test_linear_backward_matches_matmul():
    torch.manual_seed(0)
    x = torch.randn(5, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    S.linear(x, w).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x2 @ w2.t()).sum().backward()
    # the incoming gradient is all ones: x's gradient sums w's 8 rows, w's sums x's 5 rows (in fp32 here)
    atol = TOLERANCES["strict_linear_backward_vs_fp64"][0]
    assert bool(((x.grad - x2.grad).abs() <= atol * w.detach().abs().sum(0)).all())
    assert bool(((w.grad - w2.grad).abs() <= atol * x.detach().abs().sum(0)).all())


def test_attention_decode_steps_equal_full_forward():
    """Query t alone against keys 0..t (decode with a KV cache) == row t of the causal full-sequence forward."""
    torch.manual_seed(0)
    T, b, h, d = 11, 3, 4, 16
    q, k, v = (torch.randn(T, b, h, d).bfloat16() for _ in range(3))
    full = S.attention(q, k, v, d ** -0.5)
    steps = torch.cat([S.attention(q[t:t + 1], k[:t + 1], v[:t + 1], d ** -0.5) for t in range(T)])
    assert torch.equal(steps, full)
    prefill = S.attention(q[:4], k[:4], v[:4], d ** -0.5)
    assert torch.equal(prefill, full[:4])
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=d ** -0.5).permute(2, 0, 1, 3)
    assert (full - ref).abs().max() < TOLERANCES["strict_attention_vs_sdpa_fp32"][0]


def test_softmax_rows_and_rms_norm_rows_are_batch_invariant():
    x = torch.randn(33, 50)
    assert torch.equal(S.softmax(x[3:4]), S.softmax(x)[3:4])
    atol, rtol = TOLERANCES["strict_softmax_vs_torch_fp32"]
    assert torch.allclose(S.softmax(x), torch.softmax(x, -1), atol=atol, rtol=rtol)
    w = torch.randn(50)
    assert torch.equal(S.rms_norm(x[7:9], w, 1e-6), S.rms_norm(x, w, 1e-6)[7:9])
    atol, rtol = TOLERANCES["strict_rms_norm_vs_torch_fp32"]
    want = torch.nn.functional.rms_norm(x, (50,), w, 1e-6)
    assert torch.allclose(S.rms_norm(x, w, 1e-6), want, atol=atol, rtol=rtol)


def test_topk_ties_go_to_the_lower_index():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    vals, idx = S.topk(s, 2)
    assert idx.tolist() == [[1, 2]] and vals.tolist() == [[3.0, 3.0]]


def test_log_is_correctly_rounded_and_log_softmax_is_row_invariant_with_right_gradients():
    x = torch.cat([torch.rand(50_000) * 1e6 + 1e-3, torch.rand(50_000) * 4 + 0.5, torch.tensor([1.0, 2.0, 151936.0])])
    assert torch.equal(S.log(x), torch.log(x.double()).float())
    z = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0)) * 5
    lp = S.log_softmax(z)
    assert torch.equal(S.log_softmax(z[4:5]), lp[4:5])
    ref = torch.log_softmax(z.double(), -1)
    assert ((lp.double() - ref).abs() / ref.abs().clamp(min=1)).max() < TOLERANCES["strict_log_softmax_vs_fp64"][0]
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    S.log_softmax(a)[:, 3].sum().backward()
    torch.log_softmax(b, -1)[:, 3].sum().backward()
    atol, rtol = TOLERANCES["strict_log_softmax_grad_vs_torch_fp32"]
    assert torch.allclose(a.grad, b.grad, atol=atol, rtol=rtol)


class _ScalarReads(TorchDispatchMode):
    """Ops that read a tensor back to the host on a GPU (a value comparison, a scalar read)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.equal.default, torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.item.default):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inference", [False, True])
def test_strict_rope_cache_reads_nothing_back_and_changes_nothing(inference):
    """RoPE's sin/cos are computed once per table (Megatron hands every layer slices of one cached [s, 1, 1, d]
    table) and each slice is bitwise sincos of the slice, with no value comparison (a host read on a GPU); inside
    torch.inference_mode too (the engine's case: views there keep no base and no version counter)."""
    with torch.inference_mode(inference):
        table = (torch.arange(40, dtype=torch.float32) * 0.37).reshape(20, 2)[:, None, None, :]
        S._ROPE_CACHE.clear()
        want = S.sincos(table[3:9])
        S.rope(torch.randn(6, 1, 1, 4), table[3:9])  # first use: sincos of the whole table (one range check)
        with _ScalarReads() as reads:
            got = [S._rope_sincos(table[a:b]) for a, b in ((3, 9), (0, 20), (19, 20))]
        assert reads.ops == [] and len(S._ROPE_CACHE) == 1
        assert all(torch.equal(x, y) for x, y in zip(got[0], want))
        for (sin, cos), (a, b) in zip(got[1:], ((0, 20), (19, 20))):
            ws, wc = S.sincos(table[a:b])
            assert torch.equal(sin, ws) and torch.equal(cos, wc)
    if not inference:
        table.mul_(2)  # an in-place write bumps the version counter: computed again
        assert torch.equal(S._rope_sincos(table[3:9])[0], S.sincos(table[3:9])[0]) and len(S._ROPE_CACHE) == 2


def _autograd_cases(dtype):
    """(name, strict op, its autograd twin, inputs): every op `_StrictForward` wraps, at learner-like shapes (fp32 or
    bf16 inputs; attention over all keys and, as a decode chunk, 3 queries of 7 keys)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 40, generator=g) * 3).to(dtype)
    w = (torch.rand(40, generator=g) + 0.5).to(dtype)
    idx = torch.randint(0, 40, (6,), generator=g)
    q, k, v = (torch.randn(7, 2, h, 8, generator=g).to(dtype) for h in (4, 2, 2))
    t = torch.randn(7, 2, 4, 12, generator=g).to(dtype)
    freqs = torch.rand(7, 1, 1, 8, generator=g) * 7
    return [  # eps 0.1 against a mean square ~9: a twin without it is 0.5% off; dim 0 and mscale 1.3 count too
        ("rms_norm", lambda a, b: S.rms_norm(a, b, 0.1), lambda a, b: S._plain_rms_norm(a, b, 0.1), (x, w)),
        ("softmax", S.softmax, lambda a: torch.softmax(a.float(), -1), (x,)),
        ("softmax_dim0", lambda a: S.softmax(a, 0), lambda a: torch.softmax(a.float(), 0), (x,)),
        ("silu", S.silu, lambda a: torch.nn.functional.silu(a.float()), (x,)),
        ("log_softmax", S.log_softmax, lambda a: torch.log_softmax(a.float(), -1), (x,)),
        ("log_softmax_dim0", lambda a: S.log_softmax(a, 0), lambda a: torch.log_softmax(a.float(), 0), (x,)),
        ("token_log_softmax", lambda a: S.token_log_softmax(a, idx), lambda a: S._plain_token_log_softmax(a, idx),
         (x,)),
        ("attention", lambda *a: S.attention(*a, 0.35), lambda *a: S._plain_attention(*a, 0.35), (q, k, v)),
        ("attention_chunk", lambda *a: S.attention(*a, 0.35), lambda *a: S._plain_attention(*a, 0.35), (q[4:], k, v)),
        ("rope", lambda a: S.rope(a, freqs, 1.3), lambda a: S._rotate(a, *S._rope_sincos(freqs), 1.3), (t,)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strict_ops_under_autograd_keep_their_value_and_take_their_twins_gradient(dtype):
    """Under autograd a strict op records one node (`_StrictForward`): its value is the op's own, bit for bit what it
    is without autograd, and its gradient is that of the same function in torch's ops (the learner's backward then
    runs a few launches per op instead of the graph of fp64 polynomials and pair trees)."""
    for (name, op, twin, inputs), first_only in itertools.product(_autograd_cases(dtype), (False, True)):
        with torch.no_grad():
            want = op(*inputs)
        needs = [a.is_floating_point() and (i == 0 or not first_only) for i, a in enumerate(inputs)]
        leaves = [a.clone().requires_grad_(n) for a, n in zip(inputs, needs)]
        y = op(*leaves)
        assert torch.equal(y.detach(), want) and y.dtype == want.dtype, name
        assert type(y.grad_fn).__name__ == "_StrictForwardBackward", name
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        got = torch.autograd.grad(y, [a for a in leaves if a.requires_grad], dy)
        twins = [a.clone().requires_grad_(n) for a, n in zip(inputs, needs)]
        ref = torch.autograd.grad(twin(*twins), [a for a in twins if a.requires_grad], dy)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (name, first_only)


def test_the_autograd_twins_compute_the_strict_ops_functions():
    """The twins give the gradients, so they must be the same functions: fp32 values within a few ulps (a wrong mask,
    scale or formula is O(0.1))."""
    atol, rtol = TOLERANCES["strict_op_vs_its_autograd_twin_fp32"]
    for name, op, twin, inputs in _autograd_cases(torch.float32):
        with torch.no_grad():
            a, b = op(*inputs), twin(*inputs)
        assert a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=rtol), (name, (a - b).abs().max())
