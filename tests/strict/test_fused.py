"""minite.strict.fused: the strict ops (exp, rms_norm, tree_sum, log, attention, rope) in one Triton kernel each, bit for
bit (the interpreter on the CPU; the GPU tests are in tests/alignment/test_strict_alignment_gpu.py)."""
import math

import pytest
import torch

from minite.strict import fused, ops
from minite.strict import fused_attention as FA

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 88.7, 88.73, 89.0, 89.5, -87.3, -103.9, -104.0, -149.9, -150.0,
                            -150.5, 1e-30, -1e-30, math.inf, -math.inf, math.nan, 3.4e38, -3.4e38], dtype=torch.float64)
    # x * log2(e) near half-integers, where the range reduction picks its integer (either neighbour gives the same
    # fp32 result as long as both sides use the same rule and the same fp64 operations)
    halves = torch.tensor([(k + 0.5) / 1.4426950408889634 for k in range(-20, 20)], dtype=torch.float64)
    x = torch.cat([special, halves, halves.nextafter(halves + 1), halves.nextafter(halves - 1),
                   torch.randn(3000, generator=g, dtype=torch.float64) * 30,
                   torch.empty(2000, dtype=torch.float64).uniform_(-160, 95, generator=g)])
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_exp_is_bitwise_ops_exp(dtype):
    x = _inputs(dtype)
    ref, got = ops.exp(x), fused.exp(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
    assert bool(same.all()), f"{int((~same).sum())} of {x.numel()} differ, first at x={x[~same][0].item()!r}"


def test_fused_exp_shapes_and_strides():
    x = torch.randn(7, 33, device=DEVICE).t()  # non-contiguous
    assert torch.equal(fused.exp(x), ops.exp(x))
    assert fused.exp(torch.empty(0, 3, device=DEVICE)).shape == (0, 3)


def test_ops_route_to_the_kernels_only_when_enabled_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "exp", lambda x: calls.append("exp") or torch.zeros(x.shape))
    monkeypatch.setattr(fused, "rms_norm", lambda x, w, e: calls.append("rms_norm") or x)
    monkeypatch.setattr(fused, "tree_sum", lambda x, d=-1: calls.append("tree_sum") or x.sum(d))
    assert fused.ENABLED  # on by default
    ops.exp(torch.randn(4))
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    ops.tree_sum(torch.randn(2, 4))
    assert calls == []  # a CPU tensor stays on the torch ops even when enabled
    monkeypatch.setattr(fused, "_gpu", lambda x: True)  # as if on CUDA: what else decides
    monkeypatch.setattr(fused, "ENABLED", False)
    ops.exp(torch.randn(4))
    assert calls == []  # off: the torch ops, even on a GPU
    monkeypatch.setattr(fused, "ENABLED", True)
    ops.exp(torch.randn(4))
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    ops.tree_sum(torch.randn(2, 4))
    ops.tree_sum(torch.randn(2, 4, dtype=torch.float64))  # float32 only
    assert calls == ["exp", "rms_norm", "tree_sum"]
    calls.clear()
    wide = torch.randn(2, fused.MAX_WIDTH + 1)
    ops.tree_sum(wide)  # a row wider than one program takes
    ops.tree_sum(wide, 0)  # ... but the reduced dim decides
    ops.rms_norm(wide, torch.ones(wide.shape[-1]), 1e-6)
    assert calls == ["tree_sum"]
    calls.clear()
    x = torch.randn(2, 4, requires_grad=True)  # the kernels record no backward: a tensor that needs one stays
    w = torch.ones(4, requires_grad=True)
    ops.exp(x), ops.tree_sum(x)
    assert calls == []
    y = ops.rms_norm(x.detach(), w, 1e-6)  # a whole op under autograd: its value with nothing recorded, the kernel's
    assert calls == ["rms_norm"] and type(y.grad_fn).__name__ == "_StrictForwardBackward"  # (ops._StrictForward)
    calls.clear()
    with torch.no_grad():
        ops.exp(x), ops.rms_norm(x, w, 1e-6)
    assert calls == ["exp", "rms_norm"]


def test_whole_ops_under_autograd_reach_their_kernels(monkeypatch):
    """Attention, RoPE and the log-softmax at the targets take their kernels under autograd too (`ops._StrictForward`
    computes the value with nothing recorded; before, a call that recorded a gradient stayed on the torch ops)."""
    from minite.strict import fused_attention, fused_log_softmax

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, 1, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    t = torch.randn(5, 1, 4, 8, generator=g, requires_grad=True)
    freqs = torch.rand(5, 1, 1, 8, generator=g)
    x, idx = torch.randn(3, 11, generator=g, requires_grad=True), torch.tensor([0, 4, 10])
    ops.rope(t.detach(), freqs)  # the angles' sin/cos cached on the CPU's torch ops, before the GPU is faked
    calls = []
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    monkeypatch.setattr(fused_attention, "attention",
                        lambda *a: calls.append("attention") or ops._plain_attention(*a))
    monkeypatch.setattr(fused, "rope", lambda a, sin, cos, m=1.0: calls.append("rope") or ops._rotate(a, sin, cos, m))
    monkeypatch.setattr(fused_log_softmax, "token_log_softmax",
                        lambda *a: calls.append("log_softmax") or ops._plain_token_log_softmax(*a))
    outs = [ops.attention(q, k, v, 0.3), ops.rope(t, freqs), ops.token_log_softmax(x, idx)]
    assert calls == ["attention", "rope", "log_softmax"]
    assert all(type(y.grad_fn).__name__ == "_StrictForwardBackward" for y in outs)


def _same_bits(a, b):
    """Bit for bit, any NaN matching any NaN (torch and the kernels may pick different NaN payloads)."""
    ai = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
    bi = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
    return a.dtype == b.dtype and a.shape == b.shape and bool(((ai == bi) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("n", [1, 3, 96, 1000, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_is_bitwise_ops_rms_norm(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(2, 5, n, generator=g) * torch.logspace(-3, 3, n)).to(dtype).to(DEVICE)
    x[0, 0] = 0  # an all-zero row: 0 * 1/sqrt(eps)
    x[0, 1, 0] = -0.0
    x[1, 0, 0] = math.nan  # a NaN row stays NaN (bf16: the rounding carry must not make it -0.0)
    x[1, 1, -1] = math.inf
    x[1, 2, 0] = torch.finfo(dtype).max  # its square overflows: the row is 0, NaN where x is inf... as torch does
    w = (torch.randn(n, generator=g) + 1).to(dtype).to(DEVICE)
    got = fused.rms_norm(x, w, 1e-6)
    if x.is_cuda:  # torch's CUDA sqrt is correctly rounded (sqrt.rn): ops.rms_norm itself is the reference
        ref = ops.rms_norm(x, w, 1e-6)
    else:  # ops.rms_norm's operations with a correctly rounded sqrt (torch's CPU sqrt is not always: below)
        xf = x.float()
        s = ops.tree_sum(xf * xf, -1)
        ms = s / torch.full_like(s, n)
        inv = 1.0 / torch.sqrt((ms + 1e-6).double()).float()  # binary64 sqrt rounded to binary32: correctly rounded
        ref = ((xf * inv.unsqueeze(-1)) * w.float()).to(dtype)
    assert _same_bits(got, ref)
    assert bool(got[1, 0].isnan().all()) and not bool(got[0, 2].isnan().any())


def test_torch_cpu_sqrt_is_not_always_correctly_rounded():
    """Why the CPU reference above rounds its own sqrt: torch 2.13's fp32 sqrt on this project's CPU (AVX512 build)
    gives 0.26692596 for sqrt(0.07124948), the correctly rounded value being 0.26692599 (one ulp off). It is the same
    on the vector and the scalar path, so strict mode's learner and rollout still agree on a CPU; on CUDA torch's
    sqrt is sqrt.rn, which the fused kernel's tl.sqrt_rn matches (the GPU test)."""
    g = torch.Generator().manual_seed(5)
    many = torch.rand(4099, generator=g) * 10
    assert torch.equal(torch.sqrt(many), torch.stack([torch.sqrt(many[i:i + 1])[0] for i in range(4099)]))  # paths agree
    v = torch.tensor([0.07124948] * 17, dtype=torch.float32)
    exact = torch.sqrt(v.double()).float()
    got = torch.sqrt(v)
    if torch.equal(got, exact):
        pytest.skip("this torch build's CPU sqrt is correctly rounded here")
    assert (got.view(torch.int32) - exact.view(torch.int32)).abs().max() == 1


@pytest.mark.parametrize("n", [1, 2, 3, 7, 128, 1000, 2048])
def test_fused_tree_sum_is_bitwise_ops_tree_sum(n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, n, 5, generator=g) * torch.logspace(-8, 8, 5)).to(DEVICE)  # summands of mixed magnitude
    x[0, 0, 0] = -0.0  # n == 1: the sum is the element itself, sign of zero included
    x[1, 0, 1] = math.inf
    x[2, -1, 2] = math.nan
    x[1, :, 3] = -0.0  # a sum of negative zeros is -0.0 (no +0.0 identity enters a pair) unless padding adds +0.0
    for dim in (1, -1, 0):
        assert _same_bits(fused.tree_sum(x, dim), ops.tree_sum(x, dim)), dim
    assert bool(fused.tree_sum(x, 1)[1, 3].signbit()) == (n & (n - 1) == 0)
    assert fused.tree_sum(torch.empty(4, 0, device=DEVICE), -1).eq(0).all()
    with pytest.raises(ValueError, match="float32"):
        fused.tree_sum(x.double())


def test_fused_tree_sum_is_not_a_plain_sum():
    """The order shows: 1e8 + 1 - 1e8 + 1 summed in pairs is (1e8 + 1) + (-1e8 + 1) = 0 in fp32, a sequential sum
    gives 1."""
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]], device=DEVICE)
    assert fused.tree_sum(x).item() == 0.0 and ((x[0, 0] + x[0, 1]) + x[0, 2] + x[0, 3]).item() == 1.0


def test_fused_rms_norm_refuses_a_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)


def _log_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1.4142135, 1.4142137, 0.70710677, 0.7071068, 1e-45, 1e-40,
                            1.17549435e-38, 3.4e38, math.inf, -math.inf, math.nan, 151936.0], dtype=torch.float64)
    powers = torch.tensor([2.0 ** k for k in range(-126, 128, 7)], dtype=torch.float64)
    x = torch.cat([special, powers, powers.nextafter(powers * 2), powers.nextafter(powers * 0),
                   torch.rand(3000, generator=g, dtype=torch.float64) * 4 + 1,  # log-softmax sums: >= 1
                   torch.exp(torch.randn(3000, generator=g, dtype=torch.float64) * 20)])
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_log_is_bitwise_ops_log(dtype):
    x = _log_inputs(dtype)
    got = fused.log(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "PROVEN", fused.PROVEN - {"log"})  # the reference: the torch ops
        ref = ops._log_fwd(x)
    assert _same_bits(got, ref), f"{int((got.view(torch.int32) != ref.view(torch.int32)).sum())} differ"


def test_fused_log_is_routed_only_while_proven(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "log", lambda x: calls.append(1) or torch.zeros(x.shape))
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    x = torch.rand(5) + 1
    ops.log(x)
    assert calls == [1]  # routed: log is in PROVEN
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"log"})
    ops.log(x)
    assert calls == [1]  # a kernel out of PROVEN is not routed


@pytest.mark.parametrize("sq, sk, d, dtype", [(1, 72, 128, torch.bfloat16), (3, 7, 12, torch.bfloat16),
                                              (4, 33, 8, torch.float32), (2, 2, 4, torch.float16),
                                              (1, 1, 4, torch.float32), (5, 300, 16, torch.float32)])
def test_fused_attention_is_bitwise_ops_attention(sq, sk, d, dtype, monkeypatch):
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q = (torch.randn(sq, 2, 3, d, generator=g) * 3).to(dtype).to(DEVICE)
    k = (torch.randn(sk, 2, 3, d, generator=g) * 3).to(dtype).to(DEVICE)
    v = (torch.randn(sk, 2, 3, d, generator=g) * torch.logspace(-4, 4, d)).to(dtype).to(DEVICE)  # order-sensitive
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"attention", "exp", "tree_sum"})  # the reference: torch ops
    ref = ops.attention(q, k, v, 1 / math.sqrt(d))
    for block in (FA.ATTENTION_KEY_BLOCK, 4):  # the key blocks change no bit
        monkeypatch.setattr(FA, "ATTENTION_KEY_BLOCK", block)
        got = FA.attention(q, k, v, 1 / math.sqrt(d))
        assert got.dtype == torch.float32 and _same_bits(got, ref), (block, (got - ref).abs().max())


def test_fused_attention_reads_grouped_kv_heads_in_place(monkeypatch):
    """Grouped-query attention: query head i reads KV head i // (h / g), the bits of the expanded heads."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(5, 2, 6, 16, generator=g) * 3).to(DEVICE)
    k, v = ((torch.randn(5, 2, 2, 16, generator=g) * 3).to(DEVICE) for _ in range(2))
    expanded = [t.repeat_interleave(3, dim=2) for t in (k, v)]
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"attention", "exp", "tree_sum"})  # the torch ops
    ref = ops.attention(q, *expanded, 0.25)
    assert _same_bits(ops.attention(q, k, v, 0.25), ref)
    assert _same_bits(FA.attention(q, k, v, 0.25), ref)
    for bad in (k[:, :, :0], torch.randn(5, 2, 4, 16, device=DEVICE)):  # no heads; 6 query heads over 4 groups
        with pytest.raises(ValueError, match="attention"):
            FA.attention(q, bad, bad, 0.25)
        with pytest.raises(ValueError, match="attention"):
            ops.attention(q, bad, bad, 0.25)


def test_fused_attention_grouped_decode_step_and_non_contiguous_kv(monkeypatch):
    """One query over a longer grouped cache (a decode step), k/v as strided views of a fused QKV-like tensor."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(1, 3, 8, 16, generator=g) * 3).to(DEVICE)
    kv = (torch.randn(9, 3, 2, 2, 16, generator=g) * 3).to(DEVICE)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # [9, 3, 2, 16] each, not contiguous
    assert not k.is_contiguous()
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"attention", "exp", "tree_sum"})  # the torch ops
    ref = ops.attention(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2), 0.25)
    assert _same_bits(FA.attention(q, k, v, 0.25), ref)
    with pytest.raises(ValueError, match="attention"):
        FA.attention(q[0], k, v, 0.25)  # a 3-D query: one line, not an unpacking error
    with pytest.raises(ValueError, match="attention"):
        ops.attention(q[0], k, v, 0.25)


def test_fused_pair_sums_path_under_the_interpreter(monkeypatch):
    """The GPU's form of the pair levels (a sum over the pair axis, SPLIT False) run by the interpreter, on inputs
    whose pair sums are never -0.0 + -0.0 (numpy's pair sum would give +0.0 there): the bits of the tl.split form."""
    from minite.strict import fused_linear as FL
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(1, 2, 6, 16, generator=g) * 3).to(DEVICE)
    kvs = [tuple((torch.randn(sk, 2, 3, 16, generator=g) * 3).to(DEVICE) for _ in range(2)) for sk in (7, 1, 2, 72)]
    x, w = torch.randn(5, 300, generator=g).to(DEVICE), torch.randn(300, generator=g).to(DEVICE)
    wl = torch.randn(4, 300, generator=g).to(DEVICE)

    def run():  # the attention at 7, 1, 2 and 72 keys: key blocks of 8, 1, 2 and 32 (3 of 4 computed)
        return [FA.attention(q, k, v, 0.25) for k, v in kvs] + [fused.rms_norm(x, w, 1e-6), FL.linear(x, wl)]
    split = run()
    monkeypatch.setattr(fused, "pair_split", lambda: False)
    summed = run()
    assert all(_same_bits(a, b) for a, b in zip(split, summed))


def test_fused_attention_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, 4, 2, 16, generator=g).to(DEVICE) for n in (3, 9, 9))
    full = FA.attention(q, k, v, 0.25)
    assert torch.equal(FA.attention(q[:, 1:2], k[:, 1:2], v[:, 1:2], 0.25), full[:, 1:2])
    assert torch.equal(FA.attention(q[2:], k, v, 0.25), full[2:])  # the last query alone: a decode step


def test_fused_attention_special_values_and_errors():
    q = torch.randn(1, 1, 2, 8, device=DEVICE)
    k, v = torch.randn(4, 1, 2, 8, device=DEVICE), torch.randn(4, 1, 2, 8, device=DEVICE)
    v[1, 0, 0, 3] = math.inf
    k[2, 0, 1, 0] = math.nan
    assert _same_bits(FA.attention(q, k, v, 0.5), ops.attention(q, k, v, 0.5))
    with pytest.raises(ValueError, match="attention"):
        FA.attention(q, k[:, :, :1], v, 0.5)
    with pytest.raises(ValueError, match="queries over"):
        FA.attention(torch.randn(5, 1, 2, 8, device=DEVICE), k, v, 0.5)  # more queries than keys
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        fused.log(torch.rand(3, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("sk", [9, 12])
def test_fused_attention_keys_past_the_context(sk, monkeypatch):
    """Keys past the context (the padding to a power of two) add +0 to every sum, as ops.tree_sum's zero padding
    does: the kernel reads the last key's row for their scores (no mask), never for their products with v, and does
    not compute a block of padding alone (its sums are read back as +0). Here the context's products are all -0 (p = 0
    or v = -0), so a -0 from the padding would turn the +0 of ops' tree into -0 (at 12 keys in blocks of 4 or 2, a
    block of padding alone decides it). In the second case the last key's row holds a NaN and an inf: the padding's
    scores read that row, and the queries before the last (a prefill of 3), which cannot see that key, stay finite."""
    q = torch.full((3, 1, 2, 8), 4.0, device=DEVICE)
    k = torch.full((sk, 1, 2, 8), -4.0, device=DEVICE)
    k[0] = 4.0  # key 0's score exceeds the others' by 256: their e underflow to +0
    v = -torch.rand(sk, 1, 2, 8, device=DEVICE) - 1
    v[0] = -0.0
    odd_row = k.clone()
    odd_row[-1, 0, 1, 3], odd_row[-1, 0, 0, 2], odd_row[-1, 0, 1, 5] = math.nan, math.inf, -math.inf
    for keys in (k, odd_row):
        with monkeypatch.context() as mp:
            mp.setattr(fused, "PROVEN", fused.PROVEN - {"attention", "exp", "tree_sum"})  # the reference: torch ops
            ref = ops.attention(q, keys, v, 1.0)
        for block in (FA.ATTENTION_KEY_BLOCK, 4, 2):  # 16 padded keys: with 4 or 2 a block, whole blocks of padding
            monkeypatch.setattr(FA, "ATTENTION_KEY_BLOCK", block)
            got = FA.attention(q, keys, v, 1.0)
            assert _same_bits(got, ref), block
        if keys is odd_row:  # the case is the one described
            assert torch.isfinite(ref[:2]).all() and torch.isnan(ref[2]).all()
        else:
            assert (ref.view(torch.int32) == 0).all()  # +0, not -0


def test_fused_attention_refuses_a_cache_too_wide_for_its_offsets():
    q = torch.zeros(1, 1, 1, 64, device=DEVICE).expand(1, 1 << 20, 1, 64)  # views: nothing this size is allocated
    kv = torch.zeros(1, 1, 1, 64, device=DEVICE).expand(2, 1 << 20, 1, 64)
    assert not FA.routable(q, kv) and FA.routable(q[:, :1000], kv[:, :1000])  # ops.attention keeps its torch ops
    with pytest.raises(ValueError, match="too wide"):
        FA.attention(q, kv, kv, 0.5)


def test_fused_attention_in_several_launches_and_bf16_subnormals(monkeypatch):
    """Queries split over launches (the scratch bound) give the same bits; bf16 subnormals are read exactly."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(6, 2, 2, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(9, 2, 2, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    v = (torch.randn(9, 2, 2, 8, generator=g) * 1e-39).to(torch.bfloat16).to(DEVICE)  # bf16 subnormals
    assert bool((v != 0).any())
    ref = ops.attention(q, k, v, 0.3)
    whole = FA.attention(q, k, v, 0.3)
    monkeypatch.setattr(FA, "ATTENTION_SCRATCH_BYTES", 1)  # one query per launch
    assert _same_bits(whole, ref) and _same_bits(FA.attention(q, k, v, 0.3), ref)


def _grouped_inputs(seed, sq, sk, h, g, d=16):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(sq, 2, h, d, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    k = (torch.randn(sk, 2, g, d, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    v = (torch.randn(sk, 2, g, d, generator=gen) * torch.logspace(-4, 4, d)).to(torch.bfloat16).to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("h, g, sk, chunks", [(8, 2, 75, ((32, 8, 8, 1), (8, 8, 8, 4), (8, 2, 2, 4), (0, 1, 1, 4))),
                                              (6, 2, 64, ((0, 3, 8, 4), (0, 4, 2, 4))),
                                              (12, 2, 64, ((0, 3, 4, 4), (0, 8, 2, 4)))])
def test_fused_attention_split_into_chunks_gives_the_same_bits(h, g, sk, chunks, monkeypatch):
    """A short context runs on the per-head kernel in one launch; a long one on the grouped kernel, whose program
    takes some of a KV head's query heads together over a chunk of key blocks, in four launches (scores and maxima,
    exps, p * v, the tree over the blocks). Every chunking and every number of heads a program gives the torch ops'
    bits: decode steps and a prefill, all queries in one launch or one a launch, 4 query heads a KV head (all 4, 2 or 1
    a program) with a NaN score and an inf value, 3 a KV head (all 3 padded to 4 in a program, or 1) and 6 (3 padded
    to 4, or 2) over 16 blocks in chunks of 3 (the last one shorter), 4 or 8."""
    q, k, v = _grouped_inputs(12, 3, sk, h, g)
    k[40, 1, 0, 3], v[60, 0, 1, 5] = math.nan, math.inf  # batch row 1 KV head 0 sees a NaN score, row 0 head 1 an inf
    with monkeypatch.context() as mp:
        mp.setattr(fused, "PROVEN", fused.PROVEN - {"attention", "exp", "tree_sum"})  # the reference: torch ops
        ref = ops.attention(q, k, v, 0.25)
    launches = []
    launcher = FA.launcher
    monkeypatch.setattr(FA, "launcher", lambda kernel: launches.append(kernel) or launcher(kernel))
    monkeypatch.setattr(FA, "ATTENTION_KEY_BLOCK", 4)
    monkeypatch.setattr(FA, "ATTENTION_MIN_PROGRAMS", 0)
    for one_launch, chunk, heads, count in chunks:
        monkeypatch.setattr(FA, "ATTENTION_ONE_LAUNCH_BLOCKS", one_launch)
        monkeypatch.setattr(FA, "ATTENTION_CHUNK_BLOCKS", chunk)
        monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", heads)
        for scratch in (256 << 20, 1):  # all three queries in one launch, or one query a launch
            monkeypatch.setattr(FA, "ATTENTION_SCRATCH_BYTES", scratch)
            launches.clear()
            got = FA.attention(q, k, v, 0.25)
            assert len(launches) == count * (1 if scratch > 1 else 3) and _same_bits(got, ref), (chunk, heads, scratch)
        assert _same_bits(FA.attention(q[2:], k, v, 0.25), ref[2:])  # the last query alone: a decode step


def test_chunk_blocks_keeps_short_contexts_in_one_launch_and_fills_the_gpu():
    assert (FA.ATTENTION_CHUNK_BLOCKS, FA.ATTENTION_MIN_PROGRAMS) == (8, 2048)  # the values the counts below assume
    assert FA.chunk_blocks(2048, 3) == 3  # batch 64 x 32 heads, 72 keys: one launch
    assert FA.chunk_blocks(2048, 34) == 8  # 1,064 keys: 5 chunks of 8 blocks, 10,240 programs
    assert FA.chunk_blocks(32, 34) == 1  # batch 1: 34 chunks of one block, 1,088 programs (no fewer blocks a chunk)
    assert FA.chunk_blocks(256, 34) == 4  # batch 8: 9 chunks of 4 blocks, 2,304 programs
    assert all(FA.chunk_blocks(p, 256) in (1, 2, 4, 8) for p in (1, 7, 64, 4096))


def test_heads_per_program_divides_the_query_heads_of_a_kv_head(monkeypatch):
    assert FA.heads_per_program(8) == FA.ATTENTION_HEADS_PER_PROGRAM == 1
    monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", 8)
    assert [FA.heads_per_program(rep) for rep in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 3, 4, 6, 8, 8]
    monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", 4)
    assert [FA.heads_per_program(rep) for rep in (1, 3, 6, 8, 9)] == [1, 3, 3, 4, 3]
    monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", 0)  # read as 1
    assert FA.heads_per_program(8) == 1
    # `attention` counts a launch's programs for chunk_blocks: queries x batch x KV heads x groups of heads
    monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", 2)
    seen, chunk_blocks = [], FA.chunk_blocks
    monkeypatch.setattr(FA, "chunk_blocks", lambda programs, blocks: seen.append(programs) or chunk_blocks(programs,
                                                                                                          blocks))
    q, k, v = _grouped_inputs(2, 3, 9, 8, 2)  # 3 queries, batch 2, 8 query heads over 2 KV heads: 4 a KV head
    FA.attention(q, k, v, 0.25)
    assert seen == [3 * 2 * 2 * (4 // 2)]


def _rope_same(got, ref):
    a, b = got.float(), ref.float()
    bits = got.view(torch.int16) == ref.view(torch.int16) if got.element_size() == 2 else \
        got.view(torch.int32) == ref.view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["sbhd", "sbhd_partial", "one_angle_row", "thd"])
def test_fused_rope_is_bitwise_ops_rope(dtype, layout, monkeypatch):
    """fused.rope (one launch; routed on CUDA since its GPU test passed: fused.PROVEN) against ops.rope's torch ops:
    Megatron's [s, b, h, d] with [s, 1, 1, rot] (rot = d and a partial rotary), one angle row for all positions
    (decode), SGLang's [tokens, heads, d] with [tokens, 1, rot]; mscale != 1; inf, NaN, -0.0, tiny and huge values."""
    g = torch.Generator().manual_seed(21)
    shape, fshape = {"sbhd": ((5, 2, 3, 16), (5, 1, 1, 16)), "sbhd_partial": ((5, 2, 3, 24), (5, 1, 1, 8)),
                     "one_angle_row": ((1, 4, 3, 16), (1, 1, 1, 16)), "thd": ((6, 4, 12), (6, 1, 12))}[layout]
    t = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    flat = t.view(-1)
    flat[:6] = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-40, 6e4]).to(dtype)
    if t.element_size() == 2:  # a NaN with a sign and payload past the rotary width: copied bit for bit
        t.view(torch.int16).view(-1)[shape[-1] - 1] = -16 if dtype == torch.bfloat16 else -255
    freqs = torch.rand(fshape, generator=g) * 40 + torch.arange(fshape[0]).view(-1, *[1] * (len(fshape) - 1))
    t, freqs = t.to(DEVICE), freqs.to(DEVICE)
    assert fused.rope_applies(t, freqs)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"rope", "sincos"})  # the reference: the torch ops
    for mscale in (1.0, 0.7071):
        ref = ops.rope(t, freqs, mscale)
        sin, cos = ops._rope_sincos(freqs)
        got = fused.rope(t, sin, cos, mscale)
        assert got.dtype == t.dtype and got.shape == t.shape and _rope_same(got, ref), (layout, mscale)
        assert torch.equal(got[..., freqs.shape[-1]:].view(torch.uint8), ref[..., freqs.shape[-1]:].view(torch.uint8))


def test_fused_rope_routing_and_errors(monkeypatch):
    t = torch.randn(3, 2, 2, 8, device=DEVICE)
    freqs = torch.rand(3, 1, 1, 8, device=DEVICE)
    assert not fused.rope_applies(t, torch.rand(3, 2, 1, 8, device=DEVICE))  # angles per batch row: torch ops
    assert not fused.rope_applies(t, torch.rand(3, 1, 1, 7, device=DEVICE))  # odd rot
    assert not fused.rope_applies(t.double(), freqs)  # fp64: the torch ops
    with pytest.raises(ValueError, match="rope"):
        fused.rope(t, *ops._rope_sincos(torch.rand(2, 1, 1, 8, device=DEVICE)))  # 2 angle rows for 3 positions
    calls = []
    monkeypatch.setattr(fused, "rope", lambda *a: calls.append(1) or torch.zeros_like(a[0]))
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    ops.rope(t, freqs)
    assert calls == [1]  # routed: rope is in PROVEN
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"rope"})
    ops.rope(t, freqs)
    assert calls == [1]  # a kernel out of PROVEN is not routed


def test_fused_rope_real_angles_and_subnormals(monkeypatch):
    """The H200 test's cases at CPU sizes: RoPE angles of Qwen3 (theta 1e6, head 128) from position 0 (cos 1, sin
    0: a bf16 subnormal passes through exactly, which Triton's interpreter would flush in a bf16 cast), a decode
    position, a partial rotary, SGLang's layout; mscale 0.875."""
    g = torch.Generator().manual_seed(6)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    for shape, positions, rot in (((8, 2, 3, 128), torch.arange(8), 128), ((1, 4, 3, 128), torch.tensor([4093]), 128),
                                  ((4, 2, 2, 128), torch.arange(100, 104), 64), ((5, 3, 128), torch.arange(5), 128)):
        ang = positions.float()[:, None] * inv[: rot // 2][None, :]
        freqs = torch.cat([ang, ang], dim=-1).view(positions.numel(), *[1] * (len(shape) - 2), rot).to(DEVICE)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            t = (torch.randn(shape, generator=g) * 4).to(dtype)
            t.view(-1)[:4] = torch.tensor([math.inf, math.nan, -0.0, 1e-40]).to(dtype)
            t = t.to(DEVICE)
            with monkeypatch.context() as mp:
                mp.setattr(fused, "PROVEN", fused.PROVEN - {"rope", "sincos"})  # the reference: the torch ops
                ref = ops.rope(t, freqs, 0.875)
            got = fused.rope(t, *ops._rope_sincos(freqs), 0.875)
            assert _rope_same(got, ref), (shape, dtype)
            assert torch.equal(fused.rope(t[:, 1:2], *ops._rope_sincos(freqs), 0.875), got[:, 1:2])


def _sincos_inputs():
    g = torch.Generator().manual_seed(31)
    quarter = torch.arange(-400, 400, dtype=torch.float64) * (math.pi / 4)  # quadrant edges and their neighbours
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    rope = (torch.arange(0, 40960, 97, dtype=torch.float64)[:, None] * inv[None, :]).reshape(-1)
    x = torch.cat([torch.tensor([0.0, -0.0, 1e-45, -1e-38, 1.0, -1.0, 2.0 ** 20 - 1, -(2.0 ** 20 - 1), math.nan],
                                dtype=torch.float64),
                   quarter, quarter.nextafter(quarter + 1), quarter.nextafter(quarter - 1), rope,
                   (torch.rand(5000, generator=g, dtype=torch.float64) * 2 - 1) * (2.0 ** 20 - 1),
                   torch.randn(3000, generator=g, dtype=torch.float64) * 10])
    return x.float().to(DEVICE)


def test_fused_sincos_is_bitwise_ops_sincos(monkeypatch):
    """fused.sincos (one launch; routed on CUDA since its GPU test passed: fused.PROVEN) against ops.sincos' torch
    ops: quadrant edges, RoPE angles of Qwen3 up to position 40,959, the range's ends, zeros, tiny values, NaN."""
    x = _sincos_inputs()
    with monkeypatch.context() as mp:
        mp.setattr(fused, "PROVEN", fused.PROVEN - {"sincos"})  # the reference: the torch ops
        ref_s, ref_c = ops.sincos(x)
    got_s, got_c = fused.sincos(x)
    for got, ref in ((got_s, ref_s), (got_c, ref_c)):
        same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
        assert bool(same.all()), f"{int((~same).sum())} differ, first at x={x[~same][0].item()!r}"
    with pytest.raises(ValueError, match="float32"):
        fused.sincos(x.double())
    for name in ("_TWO_OVER_PI", "_PIO2_1", "_PIO2_2", "_PIO2_3", "_SIN_COEFFS", "_COS_COEFFS"):
        assert getattr(fused, name) == getattr(ops, name), name  # the kernel's constants are ops.sincos' own


def test_try_kernels_names_waiting_kernels_only():
    """MINITE_TRY_KERNELS adds waiting kernels to PROVEN (a benchmark's A/B before their GPU test); a proven name in
    it changes nothing, and any other name is refused, not ignored (the parsing is
    `fused.tried`, the import's use of it runs in a subprocess)."""
    import os
    import subprocess
    import sys

    assert fused.tried(" expert_swiglu,new_kernel,,", waiting=frozenset({"new_kernel"})) == {"new_kernel"}
    assert fused.tried("combine_rows_dtype,expert_swiglu") == frozenset()  # proven
    with pytest.raises(ValueError, match="MINITE_TRY_KERNELS names compact_with_graph: not a kernel waiting"):
        fused.tried("combine_rows_dtype,compact_with_graph", waiting=frozenset({"new_kernel"}))
    code = ("import logging; logging.basicConfig(); from minite.strict import fused; "
            "print(sorted(fused.TRIED), 'combine_rows_dtype' in fused.PROVEN)")
    env = dict(os.environ, MINITE_TRY_KERNELS=" expert_swiglu,combine_rows_dtype,,")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True" and "MINITE_TRY_KERNELS" not in out.stderr
    env["MINITE_TRY_KERNELS"] = "combine_rows_dtype,compact_with_graph"  # a misspelt name: refused at import
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and ("ValueError: MINITE_TRY_KERNELS names compact_with_graph: not a kernel waiting for "
                                    "its GPU test") in out.stderr


def test_each_waiting_name_names_its_gpu_test():
    """fused.WAITS_FOR: every waiting name's GPU test is a test function that exists (tools/gpu_acceptance.sh's gate
    stage runs these node ids on the H200; a renamed test must not leave a name waiting for nothing)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert fused.WAITING == set(fused.WAITS_FOR) and not fused.WAITING & (fused.PROVEN - fused.TRIED)
    for name, nodes in fused.WAITS_FOR.items():
        for node in nodes.split():
            path, func = node.split("::")
            assert f"\ndef {func}(" in (root / path).read_text(), (name, node)
