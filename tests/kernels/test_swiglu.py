"""SwiGLU + fused NVFP4 quantisation: the quantised output is bitwise quantize_reference(a); values match torch."""
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
