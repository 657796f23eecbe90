"""minite.kernels.qk_norm_rope: a decode step's q/k RMSNorm, RoPE and KV cache write in one launch. On the CPU the
interpreted kernel against `reference` (torch's CUDA RMSNorm order in torch ops, Megatron's RoPE arithmetic) bit for
bit; on the GPU (marker gpu) against torch.nn.RMSNorm and Megatron's RoPE themselves, the ops it replaces."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from minite.kernels import qk_norm_rope as K


@triton.jit
def _rstd_kernel(x_ptr, out_ptr, eps, D: tl.constexpr, MATH: tl.constexpr):
    """Each row's rstd as the kernel computes it (`_torch_rms`), one row a program."""
    r = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)[:, None]
    tl.store(out_ptr + r + tl.arange(0, 1), K._torch_rms(x_ptr + r * D + one * 0, one == 0, eps, D, 1, MATH))


def _kernel_rstd(x, eps):
    from minite.kernels.megatron_rope import math_functions
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _rstd_kernel[(x.shape[0],)](x, out, eps, D=x.shape[1], MATH=math_functions())
    return out


def _wide_rows(rows, d, seed, device="cpu"):
    """bf16 rows whose elements span 2^-8..2^8 in size: sums of squares whose order shows in the last bit of rstd
    (a review found a different lane, warp or vector order in 5-20% of such rows, at d = 512 for the warps')."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (rows, d), generator=gen).float())
    return (torch.randn(rows, d, generator=gen) * scale).bfloat16().to(device)


def _freqs(positions, d, theta=1_000_000.0, device="cpu"):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    f = torch.outer(positions.to(device).float(), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # Megatron's [s, 1, 1, d]


def _inputs(s, b, g, rep, d, seed, device="cpu", scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    mixed = (torch.randn(s, b, g, (rep + 2) * d, generator=gen) * scale).bfloat16()
    qw = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    kw = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    qf, kf = _freqs(torch.arange(s) + 11, d), _freqs(torch.arange(s) + 5, d)
    return [t.to(device) for t in (mixed, qw, kw, qf, kf)]


def _run(mixed, rep, qw, kw, qf, kf, mscale=1.0, eps=(1e-6, 1e-5)):
    s, b, g, width = mixed.shape
    d = width // (rep + 2)
    cache_k = torch.full((s + 3, b + 2, g, d), 7.0, dtype=torch.bfloat16, device=mixed.device)
    cache_v = torch.full_like(cache_k, 7.0)
    q = K.qk_norm_rope_cache(mixed, rep, qw, kw, eps[0], eps[1], qf, kf, mscale, cache_k[2: 2 + s, 1: 1 + b],
                             cache_v[2: 2 + s, 1: 1 + b])
    return q, cache_k, cache_v


def _same(a, b) -> bool:
    """Bit for bit, a NaN matching any NaN (its payload and sign are the convert's, not the arithmetic's); prints
    where they first differ."""
    nan = torch.isnan(a)
    bits = (a.view(torch.int16) != b.view(torch.int16)) & ~(nan & torch.isnan(b))
    if bits.any():
        at = tuple(bits.nonzero()[0].tolist())
        print(f"{int(bits.sum())} of {bits.numel()} differ, first at {at}: {a[at].item()!r} against {b[at].item()!r}")
    return not bits.any()


def _numpy(fn):
    return lambda x: torch.from_numpy(getattr(np, fn)(x.numpy()))


interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test (on a GPU the test below "
                                                                  "compares the kernel with torch and Megatron)")
SHAPES = [(1, 3, 2, 4, 16), (1, 2, 1, 8, 128), (2, 2, 2, 1, 64), (1, 1, 1, 3, 512), (3, 1, 2, 2, 4)]


@interpreted
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_the_reference_bit_for_bit(shape):
    """Random heads, a zero row, huge and tiny rows, a NaN and an Inf: queries, the key and value cache rows, and
    nothing else in the cache touched."""
    s, b, g, rep, d = shape
    mixed, qw, kw, qf, kf = _inputs(s, b, g, rep, d, seed=sum(shape))
    mixed[0, 0, 0, :d] = 0  # a zero query row: rstd = 1 / sqrt(eps)
    mixed[-1, -1, -1, rep * d: (rep + 1) * d] *= 2.0 ** 100  # a key whose squares overflow fp32: rstd 0
    if rep > 1:
        mixed[0, -1, 0, d: 2 * d] *= 2.0 ** -60
        mixed[0, -1, 0, d + 1] = float("nan")
    mixed[-1, 0, -1, 2] = float("inf")
    q, cache_k, cache_v = _run(mixed, rep, qw, kw, qf, kf, mscale=0.9)
    rq, rk, rv = K.reference(mixed, rep, qw, kw, 1e-6, 1e-5, qf, kf, 0.9, cos=_numpy("cos"), sin=_numpy("sin"))
    assert q.is_contiguous() and q.shape == (s, b, g * rep, d)
    assert _same(q, rq)
    assert _same(cache_k[2: 2 + s, 1: 1 + b], rk)
    assert torch.equal(cache_v[2: 2 + s, 1: 1 + b], rv)
    untouched = torch.ones_like(cache_k, dtype=torch.bool)
    untouched[2: 2 + s, 1: 1 + b] = False
    assert (cache_k[untouched] == 7).all() and (cache_v[untouched] == 7).all()


@interpreted
def test_strided_input_and_head_order():
    """A view of a wider buffer (the QKV output's rows strided) gives the contiguous copy's bits; query head i of
    group g is output head g * rep + i (Megatron's reshape of the split)."""
    s, b, g, rep, d = 2, 3, 2, 4, 16
    mixed, qw, kw, qf, kf = _inputs(s, b, g, rep, d, seed=1)
    wide = torch.zeros(s, b, g, (rep + 2) * d + 16, dtype=torch.bfloat16)
    wide[..., : (rep + 2) * d] = mixed
    view = wide[..., : (rep + 2) * d]
    assert torch.equal(_run(view, rep, qw, kw, qf, kf)[0], _run(mixed, rep, qw, kw, qf, kf)[0])
    # one table for queries and keys (what Megatron hands over): the keys' angles are the queries'
    q, cache_k, _ = _run(mixed, rep, qw, kw, qf, qf)
    rq, rk, _ = K.reference(mixed, rep, qw, kw, 1e-6, 1e-5, qf, qf, 1.0, cos=_numpy("cos"), sin=_numpy("sin"))
    assert _same(q, rq) and _same(cache_k[2: 2 + s, 1: 1 + b], rk)
    ones = torch.ones(d, dtype=torch.bfloat16)
    zero = torch.zeros(s, 1, 1, d)
    q = _run(mixed, rep, ones, ones, zero, zero)[0]  # cos 1, sin 0: the normalised heads themselves
    for grp in range(g):
        for i in range(rep):
            head = mixed[..., grp, i * d: (i + 1) * d]
            assert torch.equal(q[:, :, grp * rep + i], K.torch_order_rms_norm(head, ones, 1e-6))


@interpreted
@pytest.mark.parametrize("d", [16, 128, 512])
def test_rstd_is_the_reference_order_on_wide_rows(d):
    """The kernel's sum of squares, lane and warp trees: rstd of rows of a wide range, bit for bit the reference's
    (the output bf16 rounding hides most order changes; rstd does not)."""
    x = _wide_rows(600, d, seed=d)
    assert torch.equal(_kernel_rstd(x, 1e-6).view(torch.int32), K.torch_order_rstd(x.float(), 1e-6).view(torch.int32))


def test_torch_order_rms_norm_is_an_rms_norm():
    """The reference order is a sum of squares, mean and rsqrt like any RMSNorm: within one bf16 rounding of the
    float64 value (it decides only which of the two nearest bf16 values comes out)."""
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 5).bfloat16()
    w = (torch.rand(128, generator=torch.Generator().manual_seed(4)) + 0.5).bfloat16()
    got = K.torch_order_rms_norm(x, w, 1e-6).double()
    xd = x.double()
    exact = w.double() * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** -100))) - 7)
    assert ((got - exact).abs() <= ulp).all()


def test_bad_shapes_say_so():
    mixed, qw, kw, qf, kf = _inputs(1, 2, 2, 4, 16, seed=0)
    with pytest.raises(ValueError, match="qk_norm_rope: bf16 mixed_qkv"):
        K.qk_norm_rope_cache(mixed[..., :-16], 4, qw, kw, 1e-6, 1e-6, qf, kf, 1.0, mixed, mixed)
    cache = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_freqs must be torch.float32"):
        K.qk_norm_rope_cache(mixed, 4, qw, kw, 1e-6, 1e-6, qf.double(), kf, 1.0, cache, cache.clone())
    with pytest.raises(ValueError, match=r"key_out must be torch.bfloat16 \(1, 2, 2, 16\)"):
        K.qk_norm_rope_cache(mixed, 4, qw, kw, 1e-6, 1e-6, qf, kf, 1.0, cache[:, :1], cache.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 64, 128, 256, 512])
def test_rstd_is_torchs_on_the_gpu(d):
    """The kernel's rstd against torch's own CUDA RMSNorm's (aten._fused_rms_norm returns it), bit for bit, on 100,000
    rows of a wide range at each width up to MAX_HEAD (d 512 uses all four warps' trees)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = _wide_rows(100_000, d, seed=d, device="cuda")
    w = torch.ones(d, dtype=torch.bfloat16, device="cuda")
    want = torch.ops.aten._fused_rms_norm(x, [d], w, 1e-6)[1].reshape(-1)
    got = _kernel_rstd(x, 1e-6)
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert not differ.any(), f"{int(differ.sum())} of {x.shape[0]} rows differ at d = {d}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 64, 4, 8, 128), (1, 1, 4, 8, 128), (5, 3, 2, 4, 64), (2, 2, 1, 2, 16)])
def test_kernel_is_torch_and_megatron_on_the_gpu(shape):
    """The ops it replaces, on the GPU: torch.nn.RMSNorm (bf16 weights, eps 1e-6) on Megatron's split (the query's
    reshape copies it, the key's strided view goes to rms_norm as it is), then Megatron's RoPE
    (_apply_rotary_pos_emb_bshd, mscale 1 and 0.9), bit for bit; with a zero row, a huge row, a NaN and an Inf."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    s, b, g, rep, d = shape
    for seed, mscale in ((0, 1.0), (1, 0.9)):
        mixed, qw, kw, qf, kf = _inputs(s, b, g, rep, d, seed=seed + sum(shape), device="cuda")
        mixed[0, 0, 0, :d] = 0
        mixed[-1, -1, -1, rep * d: (rep + 1) * d] *= 2.0 ** 100
        mixed[-1, 0, -1, 2] = float("nan")
        mixed[0, -1, 0, d + 3] = float("inf")
        q_norm, k_norm = (torch.nn.RMSNorm(d, eps=1e-6, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        with torch.no_grad():
            q_norm.weight.copy_(qw)
            k_norm.weight.copy_(kw)
            query, key, value = torch.split(mixed, [rep * d, d, d], dim=3)
            want_q = _apply_rotary_pos_emb_bshd(q_norm(query.reshape(s, b, g * rep, d)), qf, mscale=mscale)
            want_k = _apply_rotary_pos_emb_bshd(k_norm(key), kf, mscale=mscale)
            q, cache_k, cache_v = _run(mixed, rep, qw, kw, qf, kf, mscale=mscale, eps=(1e-6, 1e-6))
        assert _same(q, want_q), (shape, seed)
        assert _same(cache_k[2: 2 + s, 1: 1 + b], want_k), (shape, seed)
        assert _same(cache_v[2: 2 + s, 1: 1 + b], value), (shape, seed)
