"""Stochastic rounding (reproducible, unbiased, neighbours only) and the random Hadamard transform."""
import torch

from minite.nvfp4 import apply_rht, gemm, quantize, rht_matrix, uniform_u24
from minite.nvfp4.hadamard import RHT_SIGNS

from ..tolerances import TOLERANCES


def _unit_multiplier_rows(values: torch.Tensor) -> torch.Tensor:
    """Rows of 32: [10.5, 0 x 15 | 6, values x 15]. S_enc = 256 and block 1 has amax 6, so its multiplier is exactly 1
    and its codes are E2M1 rounding of `values` themselves (see test_nvfp4_quantize._block_row)."""
    n = values.shape[0]
    x = torch.zeros(n, 32)
    x[:, 0] = 10.5
    x[:, 16] = 6.0
    x[:, 17:] = values[:, None]
    return x


def test_same_seed_same_codes_other_seed_other_codes():
    x = torch.randn(64, 64)
    a = quantize(x, rounding="stochastic", seed=5)
    assert a.equal(quantize(x, rounding="stochastic", seed=5))
    assert not torch.equal(a.data, quantize(x, rounding="stochastic", seed=6).data)


def test_stochastic_rounding_picks_only_the_two_neighbours():
    v = torch.linspace(-6, 6, 257)
    x = _unit_multiplier_rows(v)
    deq = quantize(x, scale_scope="row", rounding="stochastic", seed=11).dequantize()[:, 17:]
    grid = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    lo = grid[torch.searchsorted(grid, v, right=True) - 1].clamp(max=6)
    hi = grid[torch.searchsorted(grid, v, right=False).clamp(max=len(grid) - 1)]
    assert bool(((deq == lo[:, None]) | (deq == hi[:, None])).all())


def test_stochastic_rounding_is_unbiased():
    # Each element rounds to lo or hi = lo + h with P(hi) = (v - lo) / h: a Bernoulli of variance <= h^2 / 4. The mean
    # of N independent draws then has standard deviation <= h / (2 sqrt(N)); we allow TOLERANCES["monte_carlo_sigmas"]
    # standard deviations (the seeds are fixed, so the outcome is deterministic).
    values = torch.tensor([0.1, 0.3, 0.8, 1.3, 1.9, 2.2, 2.9, 3.3, 4.5, 5.9, -0.7, -2.6, -5.1])
    rows_per_value = 256
    x = _unit_multiplier_rows(values.repeat_interleave(rows_per_value))
    total = torch.zeros(len(values))
    seeds = range(8)
    for seed in seeds:
        deq = quantize(x, scale_scope="row", rounding="stochastic", seed=seed).dequantize()[:, 17:]
        total += deq.reshape(len(values), -1).sum(1)
    n = rows_per_value * 15 * len(seeds)
    mean = total / n
    step = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 1, 1, 1, 2, 2, 0.5, 1, 2])
    sigmas = TOLERANCES["monte_carlo_sigmas"][0]
    assert bool(((mean - values).abs() <= sigmas * step / (2 * n ** 0.5)).all()), (mean - values)


def test_nearest_rounding_is_biased_where_stochastic_is_not():
    x = _unit_multiplier_rows(torch.full((64,), 2.4))
    assert quantize(x, scale_scope="row").dequantize()[:, 17:].eq(2.0).all()


def test_uniform_u24_range_and_spread():
    idx = torch.arange(1 << 16)
    u = uniform_u24(123, idx)
    assert int(u.min()) >= 0 and int(u.max()) < 2**24
    hist = torch.bincount(u >> 20, minlength=16).float()  # 16 bins of 4096 expected each
    assert bool(((hist - 4096).abs() < TOLERANCES["monte_carlo_sigmas"][0] * 4096 ** 0.5).all())
    assert not torch.equal(u, uniform_u24(124, idx))


def test_rht_matrix_is_exactly_orthogonal():
    m = rht_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16))
    assert tuple(int(s) for s in (m[:, 0] * 4).tolist()) == RHT_SIGNS


def test_rht_is_exactly_invertible_on_exact_inputs():
    # small integers: every partial sum is a multiple of 1/4 below 2^20, exact in fp32, so x M M^T == x exactly
    x = torch.randint(-64, 64, (8, 48)).float()
    y = apply_rht(x)
    back = (y.reshape(8, 3, 16) @ rht_matrix().t()).reshape(8, 48)
    assert torch.equal(back, x)


def test_rht_round_trip_in_fp32():
    x = torch.randn(16, 64) * 100
    back = (apply_rht(x).double().reshape(16, 4, 16) @ rht_matrix().double().t()).reshape(16, 64)
    atol, _ = TOLERANCES["rht_roundtrip"]
    assert float((back - x.double()).abs().max()) <= atol * float(x.abs().max())


def test_rht_follows_the_fixed_left_to_right_order():
    x = torch.randn(4, 16)
    m = rht_matrix()
    expect = torch.zeros(4, 16)
    for j in range(16):
        acc = x[:, 0] * m[0, j]
        for i in range(1, 16):
            acc = acc + x[:, i] * m[i, j]
        expect[:, j] = acc
    assert torch.equal(apply_rht(x), expect)


def test_rht_on_both_operands_preserves_the_product():
    a, b = torch.randn(8, 64), torch.randn(12, 64)
    exact = a.double() @ b.double().t()
    via = apply_rht(a).double() @ apply_rht(b).double().t()
    assert float((via - exact).abs().max()) < TOLERANCES["rht_product_fp32"][0]
    qa, qb = quantize(a, rht=True), quantize(b, rht=True)
    rel = (gemm(qa, qb).double() - exact).norm() / exact.norm()
    assert float(rel) < TOLERANCES["nvfp4_gemm_rht_vs_exact"][1]  # 4-bit quantisation error
