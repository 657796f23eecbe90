"""FiniteFlag across inference mode: a generate (torch.inference_mode) may make the flag, a weight update or a train
step records into it afterwards outside inference mode; an inference tensor there could not be updated in place
("Inplace update to inference tensor outside InferenceMode")."""
import pytest
import torch

from minite.ops.common import FiniteFlag


def test_flag_made_under_inference_mode_records_outside_it():
    flag = FiniteFlag()
    with torch.inference_mode():
        flag.record(torch.ones(4))
    flag.record(torch.full((2,), 3.0))  # raised before the flag was made outside inference mode
    flag.check("a step")  # all finite: no error
    with torch.inference_mode():
        flag.record(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="NaN or Inf reached an NVFP4 quantiser during a generate"):
        flag.check("a generate")
    flag.check("the next step")  # check resets the flag


def test_check_over_a_process_group_agrees():
    """check(group=...) all-reduces "anything non-finite" so every rank raises together (under EP a NaN in one rank's
    experts must not leave the other ranks waiting in the next collective); here one gloo rank: the collective runs
    and the verdicts are those of the local check, with and without a recorded flag."""
    import torch.distributed as dist

    from tests.distributed_backend import free_port

    started = not dist.is_initialized()
    if started:  # destroyed at the end: a later test's learner on a GPU starts NCCL (gloo cannot reduce CUDA tensors)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        flag = FiniteFlag()
        flag.check("nothing recorded", group=group)  # no flag yet: still takes part in the collective
        flag.record(torch.ones(3))
        flag.check("finite", group=group)
        flag.record(torch.tensor([float("nan")]))
        with pytest.raises(ValueError, match="during a generate"):
            flag.check("a generate", group=group)
        flag.check("after the reset", group=group)
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_max_kernel_is_the_inf_norm_and_counts_nan_as_inf(dtype):
    """minite.kernels.finite_max (what `record` runs on CUDA tensors; here under Triton's interpreter) keeps the
    flag the exact running max of |x| over several blocks, and turns it non-finite for a NaN or an Inf anywhere."""
    pytest.importorskip("triton")
    from minite.kernels.finite_max import BLOCK, finite_max_into
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs it on the CPU (conftest.py)
    x = (torch.randn(3 * BLOCK + 5, device=dev) * 7).to(dtype)
    flag = torch.zeros((), dtype=torch.float32, device=dev)
    finite_max_into(x, flag)
    assert flag.item() == x.float().abs().max().item()
    finite_max_into(torch.zeros(10, dtype=dtype, device=dev), flag)  # a smaller max leaves it
    assert flag.item() == x.float().abs().max().item()
    for bad in (float("nan"), float("-inf")):
        y = torch.zeros(2 * BLOCK, dtype=dtype, device=dev)
        y[BLOCK + 3] = bad
        f = torch.zeros((), dtype=torch.float32, device=dev)
        finite_max_into(y, f)
        assert f.item() == float("inf")
    with pytest.raises(ValueError, match="one fp32 element"):
        finite_max_into(x, torch.zeros(2, device=dev))


@pytest.mark.gpu
def test_a_gpu_flag_stays_where_captured_graphs_write():
    """A record from the CPU into a flag on the GPU folds in place: the flag's storage (which captured decode graphs
    write to) is never replaced; a CPU flag moves to the GPU once."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    flag = FiniteFlag()
    flag.record(torch.ones(8, device="cuda"))
    ptr = flag._amax.data_ptr()
    flag.record(torch.tensor([float("nan")]))
    assert flag._amax.is_cuda and flag._amax.data_ptr() == ptr
    with pytest.raises(ValueError, match="during a generate"):
        flag.check("a generate")
    cpu = FiniteFlag()
    cpu.record(torch.ones(2))
    cpu.record(torch.full((3,), 5.0, device="cuda"))
    assert cpu._amax.is_cuda and float(cpu._amax) == 5.0


@pytest.mark.parametrize("case", ["row", "row-two-passes", "tensor", "16x16", "given-amax", "tensor-rht"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantiser_takes_the_flag_in_its_own_pass(case, dtype):
    """`quantize(finite_flag=)` on the Triton kernel (here under the interpreter): the flag becomes exactly what
    `finite_max_into` gives (max |x|, after the RHT where there is one; NaN or Inf anywhere: +Inf, also past the
    first tile of a long row), a larger flag stays, and the quantisation's outputs are bitwise those without the
    flag. The reference path folds the same max by torch ops."""
    pytest.importorskip("triton")
    from minite.kernels.finite_max import finite_max_into
    from minite.nvfp4 import apply_rht, quantize
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    cols = 8208 if case == "row-two-passes" else 96
    x = (torch.randn(3 if cols > 96 else 48, cols) * 7).to(dtype).to(dev)
    kw = dict(scale_scope="row" if case.startswith("row") else "tensor", check_finite=False, values=True,
              rht=case.endswith("rht"), block=(16, 16) if case == "16x16" else (1, 16))
    if case == "given-amax":
        kw["global_amax"] = x.float().abs().amax() * 2
    seen = apply_rht(x) if kw["rht"] else x
    want = torch.zeros((), dtype=torch.float32, device=dev)
    finite_max_into(seen, want)
    plain = quantize(x, backend="triton", **kw)
    for start in (0.0, float(want) * 2):
        flag = torch.full((), start, dtype=torch.float32, device=dev)
        q = quantize(x, backend="triton", finite_flag=flag, **kw)
        assert float(flag) == max(start, float(want))
        for a, b in [(q.data, plain.data), (q.scale.view(torch.uint8), plain.scale.view(torch.uint8)),
                     (q.global_scale, plain.global_scale), (q.amax, plain.amax), (q.values, plain.values)]:
            assert torch.equal(a, b)
    ref = torch.zeros((), dtype=torch.float32, device=dev)
    quantize(x, backend="reference", finite_flag=ref, **kw)
    assert float(ref) == float(want)
    for bad in (float("nan"), -float("inf")):
        y = x.clone()
        y[2, cols - 5] = bad
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        quantize(y, backend="triton", finite_flag=flag, **kw)
        assert float(flag) == float("inf")
    with pytest.raises(ValueError, match="one fp32 element"):
        quantize(x, backend="triton", finite_flag=torch.zeros(2, device=dev), **kw)
