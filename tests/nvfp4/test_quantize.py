"""NVFP4 quantisation: hand-computed vectors, the independent scalar model, errors, fuzzing. All exact."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minite.nvfp4 import E2M1_MAGNITUDES, quantize
from minite.nvfp4.quantize import e2m1_round_nearest, global_encode_scale

from .nvfp4_scalar import quantize_scalar
from ..tolerances import TOLERANCES

FLT_MAX = torch.finfo(torch.float32).max


def _block_row(values, lead=10.5):
    """A (1, 32) row: block 0 holds the global amax 10.5 (S_enc = 2688 / 10.5 = 256, a power of two, so
    S_dec = 2^-8 exactly); block 1 holds `values`. A block whose amax is 6 then gets scale 256 and multiplier
    1 / (256 * 2^-8) = 1 exactly, so its codes are E2M1 rounding of the values themselves."""
    row = torch.zeros(1, 32)
    row[0, 0] = lead
    row[0, 16:16 + len(values)] = torch.tensor(values)
    return row


def test_every_tie_rounds_to_even():
    mags = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    expect = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7]
    assert e2m1_round_nearest(mags).tolist() == expect


def test_just_off_ties_round_to_nearest():
    eps = 2.0 ** -20
    below = torch.tensor([0.75 - eps, 1.25 + eps, 2.5 + eps, 3.5 - eps, 5.0 + eps, 0.25 + eps])
    assert e2m1_round_nearest(below).tolist() == [1, 3, 5, 5, 7, 1]


def test_every_code_through_the_full_pipeline():
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    # code 8 comes from a negative value that rounds to zero (-0.0 itself gets code 0, as in TE's reference)
    q = quantize(_block_row(vals[:8] + [-0.1] + vals[9:]))
    assert float(q.global_scale) == 2.0 ** -8
    assert q.scale.float().tolist() == [[448.0, 256.0]]
    assert q.codes()[0, 16:].tolist() == list(range(16))
    assert q.dequantize()[0, 16:].tolist() == vals


def test_ties_and_saturation_through_the_full_pipeline():
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    q = quantize(_block_row(vals))
    assert q.codes()[0, 16:].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    # block amax 6.35: 6.35 * 256 / 6 = 270.9 rounds down to the E4M3 value 256, multiplier 1, and 6.35 saturates at 6
    q = quantize(_block_row([6.35, -6.35, 0.1]))
    assert q.scale.float()[0, 1] == 256.0
    assert q.dequantize()[0, 16:19].tolist() == [6.0, -6.0, 0.0]


def test_negative_value_rounding_to_zero_keeps_its_sign_and_minus_zero_is_code_0():
    # TE's reference sets the sign for x < 0: -0.2 -> code 8, but -0.0 (not < 0) -> code 0 (docs/nvfp4.md)
    q = quantize(_block_row([6.0, -0.2, 0.2, -0.0]))
    assert q.codes()[0, 16:20].tolist() == [7, 8, 0, 0]
    assert q.dequantize()[0, 17].item() == 0.0


def test_block_scale_saturates_at_448():
    x = torch.randn(64, 64)
    q = quantize(x)
    amax_block = x.abs().reshape(64, 4, 16).amax(-1).argmax()
    assert q.scale.float().flatten()[amax_block] == 448.0
    assert q.scale.float().max() == 448.0


def test_subnormal_e4m3_block_scale():
    # S_enc = 256; block amax 1e-4: 1e-4 * 256 / 6 = 0.004267 = 2.18 subnormal steps of 2^-9 -> 2 * 2^-9
    q = quantize(_block_row([1e-4, -5e-5]))
    assert q.scale.float()[0, 1] == 2 * 2.0 ** -9
    # multiplier 1 / (2^-8 * 2^-8) = 65536: 6.55 saturates to 6, -3.28 rounds to -3
    assert q.codes()[0, 16:18].tolist() == [7, 13]
    assert q.dequantize()[0, 16].item() == 6 * 2.0 ** -8 * 2.0 ** -8


def test_all_zero_blocks_and_tensors():
    q = quantize(_block_row([]))
    assert q.scale.float()[0, 1] == 0 and q.codes()[0, 16:].eq(0).all()
    z = quantize(torch.zeros(16, 32), block=(16, 16))
    assert float(z.global_scale) == 1.0 and z.scale.float().eq(0).all() and z.data.eq(0).all()
    assert z.dequantize().eq(0).all()
    zr = quantize(torch.zeros(3, 16), scale_scope="row")
    assert zr.global_scale.tolist() == [1.0, 1.0, 1.0]


def test_global_encode_scale_clamps_and_handles_zero():
    s = global_encode_scale(torch.tensor([0.0, 1e-45, 2688.0, 10.5]))
    assert s.tolist() == [1.0, FLT_MAX, 1.0, 256.0]


def test_max_input_values():
    x = torch.full((2, 16), FLT_MAX)
    x[1] = -FLT_MAX
    q = quantize(x, scale_scope="row")
    assert q.codes().tolist() == [[7] * 16, [15] * 16]
    assert torch.isfinite(q.dequantize()).all()


def test_per_row_scope_is_batch_invariant_and_per_tensor_is_not():
    torch.manual_seed(1)
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
    rows = quantize(x, scale_scope="row")
    for i in range(8):
        alone = quantize(x[i:i + 1], scale_scope="row")
        assert torch.equal(rows.data[i:i + 1], alone.data)
        assert torch.equal(rows.scale[i:i + 1].view(torch.uint8), alone.scale.view(torch.uint8))
        assert rows.global_scale[i] == alone.global_scale[0]
    tensor = quantize(x, scale_scope="tensor")
    assert not torch.equal(tensor.data[0:1], quantize(x[0:1]).data)  # row 0 is tiny next to row 7


@pytest.mark.parametrize("block,scope", [((1, 16), "tensor"), ((1, 16), "row"), ((16, 16), "tensor")])
def test_matches_independent_scalar_model(block, scope):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 48, generator=gen) * torch.logspace(-2, 2, 32)[:, None]
    x[3, :16] = 0.0  # an all-zero block
    x[5, 7] = 0.25 * x[5].abs().max()  # arbitrary extra structure
    q = quantize(x, block=block, scale_scope=scope)
    codes, scales, s_dec = quantize_scalar(x.numpy(), block[0], scope == "row")
    assert q.codes().long().numpy().tolist() == codes.tolist()
    assert q.scale.float().numpy().tolist() == scales.tolist()
    assert q.global_scale.numpy().tolist() == np.asarray(s_dec, dtype=np.float32).tolist()


@pytest.mark.parametrize("block,scope", [((1, 16), "tensor"), ((1, 16), "row"), ((16, 16), "tensor")])
def test_requantising_dequantised_values_is_identity(block, scope):
    # Holds for codes and block scales whenever every block scale is a normal E4M3 number (then a block's largest
    # code is always 6, see the module docstring of minite.nvfp4.quantize). The global scale is recomputed from the
    # dequantised amax, which differs from the original amax by the roundings in 6 * 448 * S_dec: a few ulps.
    torch.manual_seed(3)
    q = quantize(torch.randn(32, 64), block=block, scale_scope=scope)
    assert (q.scale.float() >= 2.0 ** -6).all()
    q2 = quantize(q.dequantize(), block=block, scale_scope=scope)
    codes = q.codes()
    assert bool((codes == 8).any())  # code 8 dequantises to -0.0, which requantises to code 0 (TE's sign test)
    assert torch.equal(torch.where(codes == 8, torch.zeros_like(codes), codes), q2.codes())
    assert torch.equal(q.scale.view(torch.uint8), q2.scale.view(torch.uint8))
    ulps = (q.global_scale.view(torch.int32).long() - q2.global_scale.view(torch.int32).long()).abs()
    assert int(ulps.max()) <= TOLERANCES["requantised_global_scale_ulps"][0]


def test_bf16_and_fp16_inputs_quantise_as_their_fp32_values():
    x = torch.randn(16, 32).bfloat16()
    assert quantize(x).equal(quantize(x.float()))
    assert quantize(x.half(), scale_scope="row").equal(quantize(x.half().float(), scale_scope="row"))


@pytest.mark.parametrize("bad,kwargs,match", [
    (torch.zeros(16), {}, "2-D"),
    (torch.zeros(2, 16, 16), {}, "2-D"),
    (torch.zeros(4, 24), {}, "multiple of 16"),
    (torch.zeros(8, 32), {"block": (16, 16)}, "multiples of 16"),
    (torch.zeros(4, 16, dtype=torch.int32), {}, "floating-point"),
    (torch.tensor([[float("nan")] + [0.0] * 15]), {}, "NaN or Inf"),
    (torch.tensor([[float("inf")] + [0.0] * 15]), {}, "NaN or Inf"),
    (torch.zeros(16, 16), {"block": (16, 16), "scale_scope": "row"}, "row"),
    (torch.zeros(4, 16), {"block": (2, 16)}, "block"),
    (torch.zeros(4, 16), {"rounding": "up"}, "rounding"),
    (torch.zeros(4, 16), {"scale_scope": "col"}, "scale_scope"),
    (torch.zeros(4, 16), {"rounding": "stochastic", "seed": -1}, "seed"),
    (torch.zeros(4, 16), {"backend": "cuda"}, "backend"),
])
def test_bad_input_raises_a_clear_error(bad, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(bad, **kwargs)


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):
        quantize(torch.zeros(4, 16), backend="triton")


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 3), two_d=st.booleans(), per_row=st.booleans(),
    exponent=st.integers(-30, 30), seed=st.integers(0, 2**31),
)
def test_fuzz_against_scalar_model(rows, cols, two_d, per_row, exponent, seed):
    block = (16, 16) if two_d else (1, 16)
    scope = "row" if per_row and not two_d else "tensor"
    r = rows * (16 if two_d else 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, cols * 16, generator=gen) * 2.0 ** exponent
    x[torch.rand(x.shape, generator=gen) < 0.1] = 0.0
    q = quantize(x, block=block, scale_scope=scope)
    codes, scales, s_dec = quantize_scalar(x.numpy(), block[0], scope == "row")
    assert q.codes().long().numpy().tolist() == codes.tolist()
    assert q.scale.float().numpy().tolist() == scales.tolist()
    # dequantisation error bound: half the largest E2M1 step (1.0) times the block's scale, plus saturation
    # (scale rounding is at most 1/16 relative, so |x * mult| <= 6.4 and saturation costs <= 0.4 scale units);
    # TOLERANCES["nvfp4_dequant_vs_scale_unit"] adds the fp32 roundings
    err = (q.dequantize() - x).abs()
    unit = q.expanded_scale() * (q.global_scale[:, None] if q.per_row else q.global_scale)
    bound = unit * TOLERANCES["nvfp4_dequant_vs_scale_unit"][0] + TOLERANCES["fp32_subnormal_floor"][0]
    assert bool((err <= bound).all())


def test_magnitudes_table():
    assert E2M1_MAGNITUDES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert sum(E2M1_MAGNITUDES) == 18.0  # halves and integers: exact in binary floating point
