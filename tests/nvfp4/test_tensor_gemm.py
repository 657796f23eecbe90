"""NVFP4Tensor layout (packing, transpose, dequantisation) and the reference GEMMs."""
import pytest
import torch

from minite.nvfp4 import NVFP4Tensor, gemm, grouped_gemm, pack_codes, quantize, row_slice, unpack_codes
from minite.nvfp4.backend import resolve
from tests.tolerances import TOLERANCES


def test_even_element_goes_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_pack_unpack_round_trip_all_codes():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_field_shapes_and_dtypes():
    q = quantize(torch.randn(32, 64), block=(16, 16))
    assert q.data.dtype == torch.uint8 and q.data.shape == (32, 32)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 4)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == ()
    r = quantize(torch.randn(5, 64), scale_scope="row")
    assert r.scale.shape == (5, 4) and r.global_scale.shape == (5,)
    with pytest.raises(ValueError, match="scale"):
        NVFP4Tensor(q.data, q.scale[:1], q.global_scale, q.shape, q.block)


def test_transpose_of_2d_blocks_needs_no_requantisation():
    x = torch.randn(32, 48)
    q = quantize(x, block=(16, 16))
    qt = q.t()
    assert qt.shape == (48, 32)
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    assert qt.t().equal(q)
    # and it is what quantising the transpose directly gives (a 16x16 block has one amax either way)
    assert qt.equal(quantize(x.t().contiguous(), block=(16, 16)))
    with pytest.raises(ValueError, match="16, 16"):
        quantize(x).t()


def test_block_values_are_exact_in_bf16_and_fp16():
    q = quantize(torch.randn(64, 64) * 1000, block=(16, 16))
    v = q.block_values(torch.float32)
    assert torch.equal(q.block_values(torch.bfloat16).float(), v)
    assert torch.equal(q.block_values(torch.float16).float(), v)


def test_dequantize_applies_amax_over_2688_in_fp32():
    # (e2m1 x block scale) x fl(amax / 2688): ModelOpt's formula with its weight_scale_2 (docs/nvfp4.md)
    q = quantize(torch.randn(4, 32), scale_scope="row")
    d = q.amax / torch.tensor(2688.0)
    assert torch.equal(q.dequantize(), q.block_values() * d[:, None])
    assert torch.equal(q.dequantize(torch.bfloat16), (q.block_values() * d[:, None]).bfloat16())


def test_gemm_reference_definition():
    a = quantize(torch.randn(8, 64), scale_scope="row")
    b = quantize(torch.randn(16, 64), block=(16, 16))
    acc = (a.block_values(torch.float64) @ b.block_values(torch.float64).t()).float()
    factor_inv = torch.tensor(1.0 / (6 * 6 * 448 * 448), dtype=torch.float32)  # TE's fp32 constant
    assert torch.equal(gemm(a, b), acc * ((a.amax[:, None] * b.amax) * factor_inv))
    close = (a.dequantize().double() @ b.dequantize().double().t()).float()
    magnitude = a.dequantize().double().abs() @ b.dequantize().double().abs().t()  # sum_k |a_k b_k|
    err = (gemm(a, b).double() - close.double()).abs()
    assert bool((err <= TOLERANCES["nvfp4_gemm_vs_dequantized_product"][0] * magnitude).all())
    with pytest.raises(ValueError, match="K mismatch"):
        gemm(a, quantize(torch.randn(16, 32)))


def test_gemm_rows_do_not_depend_on_the_batch():
    a = quantize(torch.randn(64, 256), scale_scope="row")
    b = quantize(torch.randn(32, 256), block=(16, 16))
    full = gemm(a, b)
    for i in (0, 17, 63):
        assert torch.equal(gemm(row_slice(a, i, i + 1), b), full[i:i + 1])


def test_grouped_gemm_equals_per_expert_gemms():
    a = quantize(torch.randn(10, 32), scale_scope="row")
    ws = [quantize(torch.randn(16, 32), block=(16, 16)) for _ in range(3)]
    counts = [4, 0, 6]
    out = grouped_gemm(a, ws, counts)
    assert torch.equal(out[:4], gemm(row_slice(a, 0, 4), ws[0]))
    assert torch.equal(out[4:], gemm(row_slice(a, 4, 10), ws[2]))
    assert torch.equal(grouped_gemm(a, ws, torch.tensor(counts)), out)
    with pytest.raises(ValueError, match="sum to"):
        grouped_gemm(a, ws, [4, 0, 5])
    with pytest.raises(ValueError, match="3 experts"):
        grouped_gemm(a, ws, [4, 6])


def test_backend_probe_explains_itself(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, reason = resolve("auto", torch.zeros(1), op="quantize")
    assert name == "reference" and reason
    with pytest.raises(ValueError, match="backend must be"):
        resolve("fast", torch.zeros(1), op="gemm")
