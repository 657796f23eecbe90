"""The learner's NVFP4 op functions on the Triton kernels (interpreter on the CPU) vs the reference backend.

Every quantisation is bitwise equal between the backends (tests/kernels/test_nvfp4_*), so forward, dgrad and wgrad
may differ only by the fp32 summation of the kernels against the reference's exact sums (tolerance below).
"""
import pytest
import torch

from minite.ops import nvfp4_grouped_linear, nvfp4_linear, quantize_expert_weights
from minite.nvfp4 import NVFP4Recipe
from tests.tolerances import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = TOLERANCES["nvfp4_op_kernels_vs_reference"][1]


def _run(fn, backend, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(backend, *leaves)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.shape[-1], device=y.device))
    return [y.detach()] + [t.grad for t in leaves]


def _close(a, b):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= RTOL * b.float().abs().max().item(), err


@pytest.mark.parametrize("counts", [[10, 0, 17, 21], [16, 16, 0, 16]])
def test_grouped_linear_kernels_match_reference(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 64, device=DEVICE)
    w = torch.randn(4, 48, 64, device=DEVICE) * torch.tensor([1.0, 0.1, 10.0, 1.0], device=DEVICE)[:, None, None]
    fn = lambda backend, xx, ww: nvfp4_grouped_linear(xx, ww, counts, NVFP4Recipe(), seed=3, backend=backend)  # noqa
    for a, b in zip(_run(fn, "triton", x, w), _run(fn, "reference", x, w)):
        _close(a, b)


def test_dense_linear_kernels_match_reference():
    torch.manual_seed(1)
    x, w = torch.randn(2, 9, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    fn = lambda backend, xx, ww: nvfp4_linear(xx, ww, NVFP4Recipe(), seed=4, backend=backend)  # noqa: E731
    for a, b in zip(_run(fn, "triton", x, w), _run(fn, "reference", x, w)):
        _close(a, b)


def test_dense_dgrad_reads_the_cached_weight_in_place():
    """The dgrad of a cached quantised weight makes no transposed copy of it on the kernels (it would stay cached
    with the weight: 2.5 B per parameter through the rest of the step), and gives the reference's gradient."""
    from minite.ops import quantize_weight
    torch.manual_seed(2)
    x, w = torch.randn(24, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        w_q = quantize_weight(w, NVFP4Recipe(), backend=backend)
        xx = x.clone().requires_grad_()
        nvfp4_linear(xx, w, NVFP4Recipe(), seed=4, weight_q=w_q, backend=backend).sum().backward()
        grads[backend] = xx.grad
        assert (w_q._transposed is None) == (backend == "triton")
    _close(grads["triton"], grads["reference"])


def test_expert_weights_carry_block_values_only_for_the_kernels():
    w = torch.randn(3, 32, 48, device=DEVICE)
    tri = quantize_expert_weights(w, NVFP4Recipe(), backend="triton")
    ref = quantize_expert_weights(w, NVFP4Recipe(), backend="reference")
    assert tri.values is not None and ref.values is None
    assert all(tri[e].equal(ref[e]) for e in range(3))


def test_packed_expert_weights_keep_the_decode_order_and_refill_it_in_place():
    """values=False on the kernels: no fp16 values, the codes also in the decode order where K % 128 == 0 (not for
    K = 272); an in-place refill writes the new weights' decode order into the old tensors; a values cache cannot
    take a packed one in place."""
    from minite.nvfp4 import decode_order
    from minite.ops.common import refill_in_place
    torch.manual_seed(3)
    old = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    assert old.values is None and torch.equal(old.decode_data, decode_order(old.data))
    odd = quantize_expert_weights(torch.randn(2, 32, 272, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    assert odd.values is None and odd.decode_data is None
    new = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton", values=False)
    ptr = old.decode_data.data_ptr()
    assert refill_in_place(old, new)
    assert old.decode_data.data_ptr() == ptr and torch.equal(old.decode_data, decode_order(new.data))
    vals = quantize_expert_weights(torch.randn(2, 32, 256, device=DEVICE), NVFP4Recipe(), backend="triton")
    assert vals.decode_data is None and not refill_in_place(vals, new)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("train_weights", [True, False])
def test_grouped_linear_keeps_its_wgrad_operand_packed(backend, train_weights, monkeypatch):
    """The grouped linear saves no copy of x for its backward: the wgrad's x^T is quantised in the forward and kept
    as packed codes and scales (no block values until the wgrad), and the gradients are bitwise those of the wgrad
    quantising x^T in the backward; with frozen weights nothing of x is kept at all."""
    from minite.ops.grouped import _grouped_wgrad
    torch.manual_seed(4)
    counts = [10, 0, 17, 21]
    x = torch.randn(sum(counts), 64, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(4, 48, 64, device=DEVICE) * 0.1).to(torch.bfloat16).requires_grad_(train_weights)
    dy = torch.randn(sum(counts), 48, device=DEVICE).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = nvfp4_grouped_linear(x, w, counts, NVFP4Recipe(), seed=5, backend=backend)
    saved = [t for t in saved if t is not None]
    assert not any(t.shape == x.shape for t in saved)  # x itself is not saved
    padded_tokens = sum(c + (-c) % 16 for c in counts)
    packed = [t for t in saved if t.dtype == torch.uint8 and tuple(t.shape) == (64, padded_tokens // 2)]
    assert len(packed) == int(train_weights)  # x^T's codes (0.5 B per element; scales 1/16 B), no block values
    assert not any(t.dtype in (torch.float16, torch.bfloat16, torch.float32) and t.numel() >= x.numel() for t in saved)
    y.backward(dy)
    if train_weights:
        want = _grouped_wgrad(dy, x.detach(), counts, NVFP4Recipe(), 5, backend, w.dtype)
        assert torch.equal(w.grad.view(torch.int16), want.view(torch.int16))
    import minite.ops.grouped as grouped
    calls = []
    monkeypatch.setattr(grouped, "quantize_column_segments", lambda *a, **k: calls.append(1))
    with torch.no_grad():  # no backward follows: nothing quantised for a wgrad, device counts taken as they are
        y0 = nvfp4_grouped_linear(x, w, torch.tensor(counts, device=DEVICE), NVFP4Recipe(), seed=5, backend=backend)
    assert torch.equal(y0, y.detach()) and not calls
    monkeypatch.undo()
    x2 = x.detach().clone().requires_grad_()
    nvfp4_grouped_linear(x2, w.detach().clone().requires_grad_(), counts, NVFP4Recipe(), seed=5,
                         backend=backend).backward(dy)
    assert torch.equal(x.grad, x2.grad)  # dgrad does not depend on what the wgrad kept
