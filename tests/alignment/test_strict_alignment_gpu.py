"""Strict mode on the GPU (marked gpu; skipped with the probe's reason elsewhere).

The fixed-K Triton GEMM must give bitwise identical rows whatever M is (that is its whole guarantee on CUDA), the
strict torch ops must stay batch invariant on CUDA, and the learner vs embedded engine gap must be exactly 0 in
strict mode on the device, for BF16 and NVFP4.
"""
import logging

import pytest
import torch

from tests.tolerances import TOLERANCES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fixed_k_gemm_rows_do_not_depend_on_m(dtype):
    from minite.strict.triton_gemm import matmul_fixed_k

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=g).to(dtype)
    w = torch.randn(1536, 1024, device="cuda", generator=g).to(dtype)
    full = matmul_fixed_k(x, w)
    for m in (1, 3, 7, 64, 65, 200):
        assert torch.equal(matmul_fixed_k(x[:m], w), full[:m]), m
        assert torch.equal(matmul_fixed_k(x[-m:], w), full[-m:]), m
    ref = x.float() @ w.float().t()
    assert (full - ref).abs().max() <= TOLERANCES["fixed_k_gemm_vs_fp32"][1] * ref.abs().max()


@pytest.mark.parametrize("dtype, k", [(torch.bfloat16, 2048), (torch.float16, 4096), (torch.bfloat16, 2080)])
def test_fixed_k_gemm_rows_do_not_depend_on_the_tile(dtype, k, monkeypatch):
    """Every tile of `triton_gemm.TILES` (and the single tile of the strict rows before it) gives a row the same bits,
    so a decode step's tile and a learner's may differ; bf16 and fp16, K a multiple of BLOCK_K or not (2080)."""
    from minite.strict import triton_gemm as TG

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(4096 + 136, k, device="cuda", generator=g) * 0.02).to(dtype)  # a partial column tile
    with monkeypatch.context() as mp:
        mp.setattr(TG, "TILES", (TG.Tile(64, 64, 4, 3),))
        ref = TG.matmul_fixed_k(x, w)
    for t in sorted({TG.Tile(64, 64, 4, 3), *TG.TILES}):
        with monkeypatch.context() as mp:
            mp.setattr(TG, "TILES", (t,))
            for m in (1, 7, 64, 256, 300):
                assert torch.equal(TG.matmul_fixed_k(x[:m], w).view(torch.int32), ref[:m].view(torch.int32)), (t, m)


def test_fixed_k_gemm_outputs_past_two_to_the_31_elements():
    """Row offsets of the output in 64 bits: the last row of a [14200, 151936] product (past 2^31 elements, the
    lm_head's vocabulary at 14,200 rows) is the row computed alone."""
    from minite.strict.triton_gemm import matmul_fixed_k

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(14200, 64, device="cuda", generator=g).bfloat16()
    w = torch.randn(151936, 64, device="cuda", generator=g).bfloat16()
    y = matmul_fixed_k(x, w)  # 8.6 GB of fp32
    assert torch.equal(y[-1], matmul_fixed_k(x[-1:], w)[0]) and torch.equal(y[0], matmul_fixed_k(x[:1], w)[0])


def test_strict_attention_and_transcendentals_on_cuda():
    from minite.strict import ops as S

    q, k, v = (torch.randn(9, 2, 4, 64, device="cuda").bfloat16() for _ in range(3))
    full = S.attention(q, k, v, 0.125)
    steps = torch.cat([S.attention(q[t:t + 1], k[:t + 1], v[:t + 1], 0.125) for t in range(9)])
    assert torch.equal(full, steps)
    x = torch.randn(100_000, device="cuda") * 20
    assert torch.equal(S.exp(x[:7]), S.exp(x)[:7])
    assert torch.equal(S.exp(x).cpu(), S.exp(x.cpu()))  # IEEE basic ops: the CPU and the GPU agree too


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_strict_gap_is_zero_on_the_gpu(precision):
    from minite.alignment.diagnose import DiagnoseParams, run_diagnose
    from minite.config import load_config
    from minite.megatron_patches import cpu as cpu_patches

    logging.getLogger("megatron").setLevel(logging.WARNING)
    cpu_patches._patch_te_general_gemm()  # 0.16.1 leaves it undefined without TE, on the GPU too
    cfg = load_config("examples/tiny/nvfp4.yaml", [f"precision.mode={precision}", "alignment.strict=true",
                                                   "model.max_position_embeddings=64"])
    r = run_diagnose(cfg, params=DiagnoseParams(num_prompts=8, max_new_tokens=8, max_prompt_len=12))
    assert r["max_abs_logp_gap"] == 0.0 and r["first_divergent_op"] is None, r["histogram"]


def test_fused_strict_ops_are_bitwise_the_torch_ops_on_cuda(monkeypatch):
    """minite.strict.fused (off until this passes on the H200): exp, rms_norm, tree_sum, the same IEEE operations as the
    torch ops of minite.strict.ops in one kernel each, FMA contraction off: the same bits on CUDA, for every input
    class and dtype; and rms_norm rows do not depend on how many rows share the call."""
    import math

    from minite.strict import fused, ops as S
    monkeypatch.setattr(fused, "ENABLED", False)  # S.exp / S.rms_norm: the torch ops
    g = torch.Generator(device="cuda").manual_seed(3)
    special = torch.tensor([0.0, -0.0, 88.7, 89.0, 89.5, -103.9, -150.0, -150.5, math.inf, -math.inf, math.nan],
                           device="cuda")
    x = torch.cat([special, torch.randn(1_000_000, device="cuda", generator=g) * 40,
                   torch.empty(1_000_000, device="cuda").uniform_(-160, 95, generator=g)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        ref, got = S.exp(xd), fused.exp(xd)
        same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
        assert bool(same.all()), f"exp {dtype}: {int((~same).sum())} differ"

    def same_bits(a, b):  # any NaN matches any NaN
        ia, ib = (t.view(torch.int16 if t.element_size() == 2 else torch.int32) for t in (a, b))
        return a.dtype == b.dtype and a.shape == b.shape and bool(((ia == ib) | (a.isnan() & b.isnan())).all())

    for n in (fused.MAX_WIDTH, 1000, 128, 1):
        for dtype in (torch.bfloat16, torch.float32):
            h = (torch.randn(64, 7, n, device="cuda", generator=g) * 3).to(dtype)
            h[0, 0] = 0
            h[0, 1, 0] = math.nan
            h[0, 2, -1] = math.inf
            h[0, 3, 0] = torch.finfo(dtype).max
            w = (torch.randn(n, device="cuda", generator=g) + 1).to(dtype)
            full = fused.rms_norm(h, w, 1e-6)
            assert same_bits(full, S.rms_norm(h, w, 1e-6)), f"rms_norm n={n} {dtype}"
            assert torch.equal(fused.rms_norm(h[3:4], w, 1e-6), full[3:4])
    for n in (1, 3, 128, 1000, fused.MAX_WIDTH):
        t = torch.randn(5, n, 3, device="cuda", generator=g) * 100
        t[0, 0, 0] = -0.0
        t[1, -1, 1] = math.nan
        t[2, 0, 2] = -math.inf
        t[3, :, 0] = -0.0  # a sum of negative zeros is -0.0: no +0.0 identity may enter a pair's addition
        for dim in (1, -1):
            assert same_bits(fused.tree_sum(t, dim), S.tree_sum(t, dim)), f"tree_sum n={n} dim={dim}"
    monkeypatch.setattr(fused, "ENABLED", True)  # the routing itself: a strict log-softmax over a vocabulary row
    logits = torch.randn(16, 151936, device="cuda", generator=g) * 5  # (exp fused, the wide tree sum not)
    calls, fused_exp = [], fused.exp
    monkeypatch.setattr(fused, "exp", lambda x: calls.append(x.shape) or fused_exp(x))
    with torch.no_grad():
        routed = S.log_softmax(logits)
    assert calls == [logits.shape]
    monkeypatch.setattr(fused, "ENABLED", False)
    with torch.no_grad():
        assert torch.equal(routed, S.log_softmax(logits))


def test_fused_log_is_bitwise_the_torch_log_on_cuda():
    """minite.strict.fused.log (routed since this passed on the H200: fused.PROVEN): ops._log_fwd's float64
    operations in one kernel, the same bits on CUDA for fp32/bf16/fp16 inputs, special values and subnormals."""
    import math

    from minite.strict import fused, ops as S
    assert "log" not in fused.PROVEN or fused.routes(torch.ones(1, device="cuda"), kernel="log")
    g = torch.Generator(device="cuda").manual_seed(4)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1.4142135, 1.4142137, 1e-45, 1e-40, 1.17549435e-38, 3.4e38,
                            math.inf, -math.inf, math.nan, 151936.0], device="cuda")
    x = torch.cat([special, torch.rand(1_000_000, device="cuda", generator=g) * 4 + 1,
                   torch.exp(torch.randn(1_000_000, device="cuda", generator=g) * 20)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        got = fused.log(xd)
        with torch.no_grad():
            saved, fused.PROVEN = fused.PROVEN, fused.PROVEN - {"log"}
            try:
                ref = S._log_fwd(xd)  # the torch ops
            finally:
                fused.PROVEN = saved
        same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
        assert bool(same.all()), f"log {dtype}: {int((~same).sum())} differ"


def test_fused_attention_is_bitwise_the_torch_attention_on_cuda(monkeypatch):
    """minite.strict.fused_attention.attention (fused.PROVEN's "attention"): ops.attention's operations per (query,
    batch x KV head) over chunks of key blocks, the same bits as the torch ops on CUDA, for decode steps (short
    contexts in one launch; 1,064 keys split into chunks, 8 query heads a KV head, batch 8 and 1), a prefill, a long
    context, 3 and 6 query heads a KV head over chunks, split contexts with 1, 2, 4 and 8 heads a program at most (6 a
    KV head as 6, 3 padded to 4, 2 or 1), and a row alone equal to the same row in the batch."""
    import math

    from minite.strict import fused, fused_attention, ops as S
    g = torch.Generator(device="cuda").manual_seed(5)
    for sq, sk, b, h, hkv, d in ((1, 72, 64, 32, 4, 128), (1, 72, 64, 32, 32, 128), (32, 32, 8, 32, 4, 128),
                                 (1, 200, 16, 32, 4, 128), (1, 4096, 2, 4, 4, 128), (3, 7, 2, 2, 1, 12),
                                 (1, 1064, 8, 32, 4, 128), (1, 1064, 1, 32, 4, 128), (5, 300, 2, 6, 2, 16),
                                 (2, 300, 2, 12, 2, 16)):
        q = (torch.randn(sq, b, h, d, device="cuda", generator=g) * 3).to(torch.bfloat16)
        k = (torch.randn(sk, b, hkv, d, device="cuda", generator=g) * 3).to(torch.bfloat16)
        v = torch.randn(sk, b, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
        v[:, 0, 0, 0] = -0.0  # every product p * v of this channel is -0.0 (p >= 0; the padding adds +0.0)
        with monkeypatch.context() as mp, torch.no_grad():
            mp.setattr(fused, "PROVEN", set())  # the reference: strict mode's torch ops alone
            ref = S.attention(q, k, v, 1 / math.sqrt(d))
        got = fused_attention.attention(q, k, v, 1 / math.sqrt(d))
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (sq, sk, (got - ref).abs().max().item())
        for heads in (8, 4, 2) if sk > 256 else ():  # split contexts with more heads a program (6 a KV head: 6, 3, 2)
            with monkeypatch.context() as mp:
                mp.setattr(fused_attention, "ATTENTION_HEADS_PER_PROGRAM", heads)
                other = fused_attention.attention(q, k, v, 1 / math.sqrt(d))
            assert torch.equal(other.view(torch.int32), ref.view(torch.int32)), (sq, sk, heads)
        alone = fused_attention.attention(q[:, :1], k[:, :1], v[:, :1], 1 / math.sqrt(d))
        assert torch.equal(alone.view(torch.int32), got[:, :1].view(torch.int32))


def test_fused_rope_is_bitwise_the_torch_rope_on_cuda(monkeypatch):
    """minite.strict.fused.rope (routed since this passed on the H200: fused.PROVEN): ops.rope's torch ops in one
    kernel, the same bits on CUDA: Megatron's prefill [s, b, h, d] with [s, 1, 1, rot] angles (Qwen3's theta 1e6,
    head 128), a decode step (one angle row), a partial rotary, SGLang's [tokens, heads, d], fp32/bf16/fp16, and a
    row alone equal to the same row in the batch."""
    import math

    from minite.strict import fused, ops as S
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"rope"})  # the reference: strict mode's torch ops
    g = torch.Generator(device="cuda").manual_seed(6)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
    for shape, positions, rot in (((64, 8, 32, 128), torch.arange(64), 128), ((1, 64, 32, 128), torch.tensor([4093]), 128),
                                  ((16, 4, 4, 128), torch.arange(100, 116), 64), ((40, 16, 128), torch.arange(40), 128)):
        ang = positions.to("cuda", torch.float32)[:, None] * inv[: rot // 2][None, :]
        freqs = torch.cat([ang, ang], dim=-1).view(positions.numel(), *[1] * (len(shape) - 2), rot)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            t = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
            t.view(-1)[:4] = torch.tensor([math.inf, math.nan, -0.0, 1e-40], device="cuda").to(dtype)
            ref = S.rope(t, freqs, 0.875)
            got = fused.rope(t, *S._rope_sincos(freqs), 0.875)
            a, b = (x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32) for x in (got, ref))
            same = (a == b) | (torch.isnan(got.float()) & torch.isnan(ref.float()))
            assert bool(same.all()), (shape, dtype, int((~same).sum()))
            assert torch.equal(fused.rope(t[:, 1:2], *S._rope_sincos(freqs), 0.875), got[:, 1:2])  # no specials there


def test_fused_sincos_is_bitwise_the_torch_sincos_on_cuda(monkeypatch):
    """minite.strict.fused.sincos (routed since this passed on the H200: fused.PROVEN): ops.sincos' float64
    operations in one kernel, the same bits on CUDA: Qwen3's RoPE angles (theta 1e6, head 128) for 131,072
    positions, quadrant edges and their neighbours, the range's ends, zeros, NaN."""
    import math

    from minite.strict import fused, ops as S
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"sincos"})  # the reference: strict mode's torch ops
    g = torch.Generator(device="cuda").manual_seed(7)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
    rope = (torch.arange(131072, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]).reshape(-1)
    quarter = (torch.arange(-4000, 4000, device="cuda", dtype=torch.float64) * (math.pi / 4)).float()
    x = torch.cat([torch.tensor([0.0, -0.0, 1e-45, -1e-38, 2.0 ** 20 - 1, -(2.0 ** 20 - 1), math.nan], device="cuda"),
                   rope, quarter, quarter.nextafter(quarter + 1), quarter.nextafter(quarter - 1),
                   (torch.rand(1_000_000, device="cuda", generator=g) * 2 - 1) * (2.0 ** 20 - 1)])
    ref = S.sincos(x)
    got = fused.sincos(x)
    for a, b in zip(got, ref):
        same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
        assert bool(same.all()), int((~same).sum())


def test_fused_linear_is_bitwise_the_torch_linear_on_cuda(monkeypatch):
    """minite.strict.fused_linear.linear (routed since this passed on the H200: "linear" in fused.PROVEN):
    ops._linear_fwd's fp32 products and tree over K in one kernel, the same bits on CUDA: the strict router at batch
    64 and at prefill size (hidden 2048 x 128 experts, fp32), bf16 operands, K not a power of two, inf/NaN/-0.0, a
    row alone equal to the same row in the batch."""
    import math

    from minite.strict import fused, fused_linear, ops as S
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {"linear", "tree_sum"})  # the reference: the torch ops
    g = torch.Generator(device="cuda").manual_seed(8)
    for m, n, k, dtype in ((64, 128, 2048, torch.float32), (4096, 128, 2048, torch.float32),
                           (64, 128, 2048, torch.bfloat16), (33, 50, 300, torch.float32), (7, 9, 1, torch.float16)):
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
        x[1, 0], x[2, -1], x[3, k // 2] = math.inf, math.nan, -0.0
        ref = S._linear_fwd(x, w)
        got = fused_linear.linear(x, w)
        same = (got.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(got) & torch.isnan(ref))
        assert bool(same.all()), (m, n, k, dtype, int((~same).sum()))
        assert torch.equal(fused_linear.linear(x[5:6], w), got[5:6])


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_strict_learner_under_autograd_gives_its_no_grad_logprobs_on_the_gpu(precision):
    """On the GPU the no-grad forward takes the fused strict kernels; under autograd `ops._StrictForward` computes
    each op's value with nothing recorded, so the kernels too: the RL loss's log-probs are bitwise the old ones (the
    first minibatch's ratio exactly 1), and the backward through the ops' torch twins gives finite gradients."""
    from minite.config import load_config
    from minite.learner.learner import Learner
    from minite.megatron_patches import cpu as cpu_patches

    logging.getLogger("megatron").setLevel(logging.WARNING)
    cpu_patches._patch_te_general_gemm()
    cfg = load_config("examples/tiny/nvfp4.yaml", [f"precision.mode={precision}", "alignment.strict=true",
                                                   "model.max_position_embeddings=64"])
    learner = Learner(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    want = learner.logprobs(tokens)
    got = learner._batch_logprobs(tokens)
    assert got.is_cuda and got.requires_grad and torch.equal(got.detach(), want)
    m = learner.train_step(tokens, lambda lp: (-lp.mean(), {}))
    assert m["step_ok"] == 1.0 and m["grad_norm"] == m["grad_norm"] and m["grad_norm"] > 0
