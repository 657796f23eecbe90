"""SwiGLU + fused NVFP4 quantisation: the quantised output is bitwise quantize_reference(a); values match torch."""
import pytest
import torch

from minite.nvfp4 import quantize_reference
from minite.kernels.nvfp4_swiglu import swiglu_bwd_triton, swiglu_quant_triton
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fused_quantisation_is_bitwise_reference_of_its_output():
    torch.manual_seed(0)
    h = torch.randn(6, 96, device=DEVICE).bfloat16()
    a, q, vals = swiglu_quant_triton(h)
    ref = quantize_reference(a, block=(1, 16), scale_scope="row", rounding="nearest", seed=None, rht=False)
    assert q.equal(ref) and torch.equal(vals, ref.block_values(torch.float16))
    expect = torch.nn.functional.silu(h[:, :48].float()).bfloat16().float() * h[:, 48:].float()
    atol, rtol = TOLERANCES["swiglu_kernel_vs_torch_bf16"]
    torch.testing.assert_close(a.float(), expect.bfloat16().float(), atol=atol, rtol=rtol)


def test_backward_matches_autograd():
    torch.manual_seed(1)
    h = torch.randn(5, 64, device=DEVICE)
    da = torch.randn(5, 32, device=DEVICE)
    hr = h.clone().requires_grad_()
    (torch.nn.functional.silu(hr[:, :32]) * hr[:, 32:]).backward(da)
    got = swiglu_bwd_triton(h, da).float()
    # fp32 math with the interpreter's / the GPU's exp: a few ulp of fp32
    atol, rtol = TOLERANCES["swiglu_bwd_kernel_vs_autograd_fp32"]
    torch.testing.assert_close(got, hr.grad, atol=atol, rtol=rtol)


def test_a_nan_stays_nan_forward_and_backward():
    """A NaN in h gives NaN where torch gives NaN, in a, in the quantised operand's block and in dh (on the GPU the
    integer bf16 rounding's carry once turned the hardware's NaN 0x7FFFFFFF into -0: a NaN became a finite zero)."""
    torch.manual_seed(2)
    h = torch.randn(4, 64, device=DEVICE).bfloat16()
    h[1, 3] = float("nan")  # a gate: a[1, 3]
    h[2, 32 + 17] = float("nan")  # an up value: a[2, 17]
    a, q, _ = swiglu_quant_triton(h)
    expect = torch.nn.functional.silu(h[:, :32].float()).bfloat16().float() * h[:, 32:].float()
    assert torch.equal(a.float().isnan(), expect.isnan()) and int(expect.isnan().sum()) == 2
    assert torch.equal(q.dequantize().isnan(), quantize_reference(a, block=(1, 16), scale_scope="row",
                                                                   rounding="nearest", seed=None,
                                                                   rht=False).dequantize().isnan())
    da = torch.randn(4, 32, device=DEVICE).bfloat16()
    hr = h.float().requires_grad_()
    (torch.nn.functional.silu(hr[:, :32]) * hr[:, 32:]).backward(da.float())
    dh = swiglu_bwd_triton(h, da)
    assert dh.dtype == torch.bfloat16 and torch.equal(dh.float().isnan(), hr.grad.isnan())
    assert int(hr.grad.isnan().sum()) >= 2


def _expert_inputs(rows, f, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * f, generator=g) * 4).bfloat16()
    h[0, :4] = torch.tensor([0.0, -0.0, 88.0, -100.0])  # zero, -0, exp overflow and underflow of -g
    probs = torch.rand(rows, generator=g)
    if rows > 1:
        probs[1] = 0.0  # a row of zeros
    if rows > 3:
        h[3] = 0.0  # an all-zero row: amax 0
    return h, probs


def _expert_reference(h, probs, exp):
    """ops.experts.swiglu's arithmetic with `exp` for the exponential: fp32 g / (1 + exp(-g)) (IEEE division),
    times up, times prob, one bf16 rounding; then the activation recipe's quantisation, with block values."""
    f = h.shape[1] // 2
    g, u = h[:, :f].float(), h[:, f:].float()
    a = (g / (1.0 + exp(-g)) * u * probs.float()[:, None]).bfloat16()
    return a, quantize_reference(a, block=(1, 16), scale_scope="row", rounding="nearest", seed=None, rht=False)


def _numpy_exp(x):  # the interpreter's libdevice exp is numpy's, in fp32
    import numpy as np
    return torch.from_numpy(np.exp(x.cpu().numpy())).to(x.device)


def test_expert_swiglu_quantisation_is_the_activation_recipes_of_the_models_swiglu():
    """The fused FC2 operand: codes, scales, per-row amax and block values are bitwise the activation recipe's
    quantisation of the model's SwiGLU (with the interpreter's exp on the CPU; with torch's own ops on the GPU,
    below); the flag takes max |a|."""
    from minite.kernels.nvfp4_swiglu import expert_swiglu_quantize_triton

    for rows, f in ((7, 48), (33, 768), (1, 16)):
        h, probs = _expert_inputs(rows, f, rows)
        flag = torch.zeros((), dtype=torch.float32, device=DEVICE)
        q = expert_swiglu_quantize_triton(h.to(DEVICE), probs.to(DEVICE), flag=flag)
        a, ref = _expert_reference(h.to(DEVICE), probs.to(DEVICE), torch.exp if DEVICE == "cuda" else _numpy_exp)
        assert q.equal(ref), (rows, f)
        assert torch.equal(q.values, ref.block_values(torch.float16))
        assert float(flag) == float(a.float().abs().max())
    h, probs = _expert_inputs(5, 32, 0)
    h[2, 40] = float("nan")  # an up value: a NaN in row 2
    flag = torch.zeros((), dtype=torch.float32, device=DEVICE)
    expert_swiglu_quantize_triton(h.to(DEVICE), probs.to(DEVICE), flag=flag)
    assert float(flag) == float("inf")


def test_expert_swiglu_refuses_bad_input():
    import pytest

    from minite.kernels.nvfp4_swiglu import expert_swiglu_quantize_triton

    h, probs = _expert_inputs(4, 24, 0)  # F = 24: not a multiple of 16
    with pytest.raises(ValueError, match="expert_swiglu_quantize needs"):
        expert_swiglu_quantize_triton(h.to(DEVICE), probs.to(DEVICE))


@pytest.mark.gpu
def test_expert_swiglu_equals_torchs_ops_on_the_gpu():
    """On the GPU the fused operand is bitwise the model's path: ops.experts.swiglu (torch's silu and products),
    then the quantiser the NVFP4 grouped linear runs, at a decode step's size and at a prefill's."""
    from minite.kernels.nvfp4_swiglu import expert_swiglu_quantize_triton
    from minite.nvfp4 import NVFP4Recipe
    from minite.ops import swiglu

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    recipe = NVFP4Recipe()
    for rows in (512, 4096):
        h, probs = _expert_inputs(rows, 768, rows)
        h, probs = h.cuda(), probs.cuda()
        q = expert_swiglu_quantize_triton(h, probs)
        ref = recipe.activation.quantize(swiglu(h, probs, strict=False), values=True)
        assert q.equal(ref) and torch.equal(q.values, ref.values)
