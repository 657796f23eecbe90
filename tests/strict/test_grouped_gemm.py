"""minite.strict.triton_gemm.grouped_matmul_fixed_k: the strict BF16 experts in one launch on device counts, row for
row the per-expert fixed-K GEMM (the interpreter on the CPU; on the GPU the same test runs compiled, and
tests/alignment/test_strict_alignment_gpu.py proves the strict decode step captured in CUDA graphs)."""
import pytest
import torch

from minite.ops import experts
from minite.ops.experts import grouped_linear_bf16, strict_grouped_applies
from minite.strict import triton_gemm as TG

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _per_expert(x, w, counts):
    return experts._per_expert(x, w, counts, TG._fixed_k)


@pytest.mark.parametrize("counts", [[0, 70, 3, 0, 10], [1, 1, 1, 1, 1], [0, 0, 129, 0, 0], [0, 0, 0, 0, 0]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_fixed_k_is_the_per_expert_gemm_row_for_row(counts, dtype):
    g = torch.Generator().manual_seed(sum(counts))
    k, n = 96, 72  # a partial K block and a partial column tile
    x = torch.randn(sum(counts), k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(len(counts), n, k, generator=g).to(dtype).to(DEVICE)
    x[0:1] = 0 if sum(counts) else x[0:1]  # a zero row
    got = TG.grouped_matmul_fixed_k(x, w, torch.tensor(counts, device=DEVICE))
    assert got.dtype == torch.float32 and got.shape == (sum(counts), n)
    want = _per_expert(x, w, counts) if sum(counts) else got
    assert torch.equal(got, want)


def test_the_grouped_kernel_is_taken_only_without_autograd_on_cuda():
    w = torch.zeros(2, 16, 16, dtype=torch.bfloat16, device=DEVICE)
    x = torch.zeros(3, 16, dtype=torch.bfloat16, device=DEVICE)
    counts = torch.tensor([1, 2], device=DEVICE)
    with torch.no_grad():
        assert strict_grouped_applies(x, w, counts) == (DEVICE == "cuda")
        assert not strict_grouped_applies(x, w, [1, 2])  # host counts: the loop
    assert not strict_grouped_applies(x, w.requires_grad_(), counts)  # the learner's strict forward: the loop
    with pytest.raises(ValueError, match="grouped_matmul_fixed_k needs"):
        TG.grouped_matmul_fixed_k(x, w.detach()[0], counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_strict_grouped_linear_is_the_loop_bitwise_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 9, (128,), device="cuda", generator=g)
    counts[::7] = 0
    x = torch.randn(int(counts.sum()), 2048, device="cuda", generator=g).bfloat16()
    w = torch.randn(128, 1536, 2048, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        got = grouped_linear_bf16(x, w, counts, strict=True)  # one launch on the device counts
        want = grouped_linear_bf16(x, w, counts.tolist(), strict=True)  # the per-expert loop
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()  # capturable: no host read of the counts
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = grouped_linear_bf16(x, w, counts, strict=True)
    graph.replay()
    assert torch.equal(captured, want)


def _loop_under_autograd(x, w, counts):
    """The strict experts as the learner ran them before _StrictExperts: ops.linear per expert on selects of w."""
    return experts._per_expert(x, w, counts, experts._strict_mm)


def _bits(t):
    return t.detach().view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.detach()


@pytest.mark.parametrize("counts", [[0, 37, 3, 0, 10, 1], [5, 5, 5, 5, 5, 5], [0, 0, 0, 0, 0, 0]])
def test_strict_experts_under_autograd_are_the_loop_with_one_gradient_buffer(counts):
    """The strict BF16 learner's experts (`_StrictExperts`): forward bitwise the per-expert loop's, gradients its
    values (the loop summed E zero-filled buffers per weight, which can turn a -0.0 into +0.0 and nothing else;
    Megatron's main_grad adds them into zeros, where both are +0.0). On a GPU the forward is the grouped kernel (the
    test below)."""
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    k, n = 40, 24
    x0 = torch.randn(sum(counts), k, generator=g).bfloat16()
    w0 = torch.randn(len(counts), n, k, generator=g).bfloat16()
    dy = torch.randn(sum(counts), n, generator=g).bfloat16()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = grouped_linear_bf16(x, w, torch.tensor(counts), strict=True)
    xl, wl = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    yl = _loop_under_autograd(xl, wl, counts) if sum(counts) else xl @ wl[0].t()
    assert type(y.grad_fn).__name__.startswith("_StrictExperts")
    assert torch.equal(_bits(y), _bits(yl))
    y.backward(dy)
    yl.backward(dy)
    for got, want in ((x.grad, xl.grad), (w.grad, wl.grad)):
        assert torch.equal(got, want)  # -0.0 == +0.0
        assert torch.equal(_bits(torch.zeros(got.shape) + got.float()), _bits(torch.zeros(want.shape) + want.float()))
    with pytest.raises(ValueError, match="must have 6 non-negative entries summing to the"):
        grouped_linear_bf16(x, w, [1] * 6, strict=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_strict_experts_under_autograd_on_cuda_are_the_loop():
    """The same on the GPU, where the forward is the grouped kernel (the strict rollout's) on the learner's counts."""
    g = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.randint(0, 40, (64,), device="cuda", generator=g)
    counts[::5] = 0
    r, k, n = int(counts.sum()), 512, 384
    x0 = torch.randn(r, k, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(64, n, k, device="cuda", generator=g) * 0.05).bfloat16()
    dy = torch.randn(r, n, device="cuda", generator=g).bfloat16()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = grouped_linear_bf16(x, w, counts.tolist(), strict=True)
    xl, wl = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    yl = _loop_under_autograd(xl, wl, counts.tolist())
    assert torch.equal(_bits(y), _bits(yl))
    y.backward(dy)
    yl.backward(dy)
    assert torch.equal(x.grad, xl.grad) and torch.equal(w.grad, wl.grad)


def test_the_fixed_k_tile_is_the_largest_that_fills_the_gpu():
    """`triton_gemm.tile` on the sweep's shapes (docs/benchmarks/fixed-k-sweep-h100.json): the lm_head (N 151936) of a
    decode batch of 128 rows or more takes the largest tile, one of 64 rows or one row the 64x64 tile; the QKV (N
    5120) and output projection (N 2048) of a decode batch of 256 keep 64x64 (a larger tile leaves the GPU
    underfilled), the output projection of 1024 rows takes the middle tile."""
    small, middle, large = TG.TILES
    assert small.block_m * small.block_n < middle.block_m * middle.block_n < large.block_m * large.block_n
    assert TG.tile(256, 151936) == TG.tile(128, 151936) == TG.tile(2048, 151936) == large
    assert TG.tile(64, 151936) == TG.tile(1, 151936) == TG.tile(256, 5120) == TG.tile(256, 2048) == small
    assert TG.tile(1024, 2048) == middle and TG.tile(1024, 5120) == TG.tile(4096, 2048) == large
