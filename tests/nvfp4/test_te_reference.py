"""minite.nvfp4 against Transformer Engine's formulas (tests/nvfp4/te_reference.py), bit for bit.

Per configuration (tile, global-scale scope, RHT) and input dtype (fp32, bf16): 256 x 512 = 131,072 elements of
random, heavy-tailed and special values (te_reference.make_inputs): codes, block-scale bytes, the global scale and
the amax, the dequantised values and a GEMM against a 16x16-block weight (TE's alpha) must all be equal.
"""
import itertools

import pytest
import torch

from minite.nvfp4 import apply_rht, gemm, quantize
from minite.nvfp4.quantize import SATURATED_AMAX, global_encode_scale

from ..tolerances import TOLERANCES
from .te_reference import exact_rht, make_inputs, te_alpha, te_dequantize, te_gemm, te_quantize, te_rht

QUANT_REL = TOLERANCES["nvfp4_quantisation_rel_error"][1]
CONFIGS = [  # (block, scale_scope, rht)
    ((1, 16), "tensor", False), ((16, 16), "tensor", False), ((1, 16), "row", False),
    ((1, 16), "tensor", True), ((1, 16), "row", True),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("cfg,dtype", list(itertools.product(CONFIGS, [torch.float32, torch.bfloat16])),
                         ids=lambda v: str(v))
def test_quantize_and_dequantize_equal_te(cfg, dtype):
    block, scope, rht = cfg
    x = make_inputs(256, 512, dtype, seed=7)
    q = quantize(x, block=block, scale_scope=scope, rht=rht, backend="reference")
    codes, scale, amax, s_dec = te_quantize(x, tile=block, row_scaled=scope == "row", rht=rht)
    assert torch.equal(q.codes(), codes)
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(_bits(q.amax), _bits(amax))
    live = amax > 0  # amax 0: TE's S_enc is FLT_MAX, minite's 1 (te_reference docstring); codes agree above
    assert torch.equal(_bits(q.global_scale[live]), _bits(s_dec[live]))
    assert torch.equal(_bits(q.dequantize()), _bits(te_dequantize(codes, scale, amax, block[0])))


@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_gemm_alpha_equals_te(scope):
    x = make_inputs(64, 256, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(48, 256, generator=g) * 0.02).to(torch.bfloat16)
    qa = quantize(x, scale_scope=scope, backend="reference")
    qb = quantize(w, block=(16, 16), backend="reference")
    ca, sa, aa, _ = te_quantize(x, row_scaled=scope == "row")
    cb, sb, ab, _ = te_quantize(w, tile=(16, 16))
    assert torch.equal(_bits(gemm(qa, qb, backend="reference")), _bits(te_gemm(ca, sa, aa, cb, sb, ab, 16)))


def test_alpha_is_tes_order_not_the_product_of_decode_scales():
    """(amax_a * amax_b) * fl(1/(6*6*448*448)) differs from S_dec_a * S_dec_b in the last bits for many amaxes:
    the arithmetic changed on purpose, and this pins which one is used."""
    g = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.randn(4096, generator=g) * 4).float()
    s_dec = torch.tensor(1.0) / (torch.tensor(2688.0) / amax)
    te = te_alpha(amax[:, None], amax[None, :1])[:, 0]
    old = s_dec * s_dec[0]
    assert bool((te != old).any())
    a = quantize(torch.diag(amax[:16]).repeat(1, 2), scale_scope="row", backend="reference")
    assert torch.equal(_bits(a.amax), _bits(amax[:16]))


def test_rht_on_bf16_rounds_to_bf16_as_te():
    x = make_inputs(64, 256, torch.bfloat16, seed=5)
    y = apply_rht(x)
    assert torch.equal(_bits(y), _bits(te_rht(x)))
    assert torch.equal(y.bfloat16().float(), y)  # every transformed value is a bf16 value
    assert bool((y != apply_rht(x.float())).any())  # and the rounding matters


def test_rht_of_fp32_subnormals_is_the_exact_transform_rounded_once():
    """Deliberate (docs/nvfp4.md, "RHT"): sign-flipped inputs are summed exactly, then scaled by 1/4 once. TE's fp32
    matmul adds products x * 1/4 that are rounded below 2^-126, one rounding per step: it differs by an ulp on some
    values (counted here, so a change of either side shows)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 256, generator=g) * 1e-39
    assert bool((x.abs() < torch.finfo(torch.float32).tiny).all())
    y = apply_rht(x)
    assert torch.equal(_bits(y), _bits(exact_rht(x)))
    assert int((y != te_rht(x)).sum()) > 0


def test_saturated_global_scale_decodes_with_the_saturated_amax():
    """amax < 2688 / FLT_MAX: S_enc clamps to FLT_MAX; the tensor carries amax = fl(2688 / FLT_MAX), so dequantize
    and the GEMM decode with ~1/FLT_MAX, the scale the codes were made with (TE's raw amax would decode far too
    small). Relative error bounds: 4-bit quantisation (tests/tolerances.py), not a tolerance on exact arithmetic."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g) * 1e-37
    q = quantize(x, backend="reference")
    assert float(global_encode_scale(x.abs().amax())) == torch.finfo(torch.float32).max
    assert q.amax.item() == SATURATED_AMAX
    err = (q.dequantize().double() - x.double()).norm() / x.double().norm()
    assert float(err) < QUANT_REL
    codes, scale, amax, _ = te_quantize(x)
    assert torch.equal(q.codes(), codes) and float(amax) < SATURATED_AMAX  # same codes, TE's amax below the bound
    w = quantize(torch.randn(16, 64, generator=g), block=(16, 16), backend="reference")
    out = gemm(q, w, backend="reference").double()
    exact = x.double() @ w.dequantize().double().t()
    assert float((out - exact).norm() / exact.norm()) < QUANT_REL


def test_weight_scale_2_does_not_determine_the_amax():
    """Why the export carries the amax (docs/nvfp4.md): over every fp32 amax in [1, 2), fl(amax / 2688) sends some
    neighbours to one value (so the alpha cannot be recovered from it), fl(fl(amax / 2688) * 2688) is within 1 ulp
    (the plugin's fallback for foreign checkpoints), and 1 / fl(2688 / amax) (S_dec) differs from fl(amax / 2688)
    for some amaxes (so the dequantisation changed bits on purpose)."""
    amax = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)
    d = amax / torch.tensor(2688.0)
    assert int((d[1:] == d[:-1]).sum()) > 0
    back = d * torch.tensor(2688.0)
    assert int((back.view(torch.int32) - amax.view(torch.int32)).abs().max()) == 1
    assert bool((torch.tensor(1.0) / (torch.tensor(2688.0) / amax) != d).any())
