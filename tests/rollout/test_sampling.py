"""minite.rollout.sampling (the Gumbel-max sampler's definition and reference) and minite.kernels.gumbel_sample (its
two Triton launches): Philox against Random123's known answers, the kernels' Philox words bitwise the reference's,
the kernels' tokens the reference's (chunk and quarter boundaries, temperature, compacted rows, +-inf and NaN, the
vocabulary clamp), draws that follow softmax(logits / T), a row's draw independent of its batch, and the decoder's
switch. On the CPU the kernels run under Triton's interpreter; the `gpu` tests run them compiled."""
import math

import pytest
import torch
import triton
import triton.language as tl

from minite.kernels import gumbel_sample as K
from minite.rollout import sampling as S
from tests.tolerances import TOLERANCES

# the kernels run under Triton's interpreter on a machine without CUDA ("cpu"), compiled on a GPU ("cuda")
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the kernels "
                                                        "run compiled (the cuda case), not interpreted")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
# Random123's kat_vectors for Philox4x32-10: (counter, key, output)
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def test_philox_gives_random123s_known_answers():
    for counter, key, out in KAT:
        assert tuple(int(w) for w in S.philox4x32(*counter, *key)) == out


@triton.jit
def _philox_words(c_ptr, k_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    w0, w1, w2, w3 = K.philox4x32(tl.load(c_ptr + 4 * i).to(tl.uint32), tl.load(c_ptr + 4 * i + 1).to(tl.uint32),
                                  tl.load(c_ptr + 4 * i + 2).to(tl.uint32), tl.load(c_ptr + 4 * i + 3).to(tl.uint32),
                                  tl.load(k_ptr).to(tl.uint32), tl.load(k_ptr + 1).to(tl.uint32))
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


@triton.jit
def _exponentials(w_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(o_ptr + i, K.exponential(w), mask=i < n)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_philox_is_bitwise_the_reference(device):
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 2 ** 32, (64, 4), generator=g, dtype=torch.int64)
    counters[0], counters[1] = 0, 0xFFFFFFFF
    for key in ((0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0)):
        out = torch.full((64, 4), -1, dtype=torch.int64, device=device)
        _philox_words[(1,)](counters.to(device), torch.tensor(key, device=device), out, N=64)
        ref = torch.stack(S.philox4x32(*counters.unbind(1), *key), 1)
        assert torch.equal(out.cpu(), ref), key
    for counter, key, answer in KAT:
        out = torch.full((1, 4), -1, dtype=torch.int64, device=device)
        _philox_words[(1,)](torch.tensor([counter], device=device), torch.tensor(key, device=device), out, N=1)
        assert tuple(out.view(-1).tolist()) == answer


def test_exponentials_are_positive_unbiased_and_reach_22_nats_of_noise():
    ends = S.exponential(torch.tensor([0, 2 ** 32 - 1]))  # the extreme words: u = 2^-33 and d = 2^-33
    assert ends[0].item() == pytest.approx(33 * math.log(2), rel=TOLERANCES["gumbel_exponential_rel"][1])
    assert -math.log(ends[1].item()) > 22  # the largest Gumbel noise: tokens 22 nats below the best can be drawn
    e = S.exponentials(12345, torch.arange(4), 3 * S.CHUNK + 7)
    assert e.shape == (4, 3 * S.CHUNK + 7) and bool(((e > 0) & torch.isfinite(e)).all())
    sigmas = TOLERANCES["monte_carlo_sigmas"][0]
    assert abs(e.mean().item() - 1) < sigmas / e.numel() ** 0.5  # Exp(1): mean 1, sd 1
    assert len(torch.unique(e)) > 0.99 * e.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_exponentials_keep_their_relative_precision_near_u_one(device):
    """e = -log(u) of Philox words (the kernels' and the reference's) within gumbel_exponential_rel of float64's
    -log((w + 0.5) 2^-32): 2^23 words spread over the range and the 2^16 at each end (the interpreter: fewer). Near
    u = 1 too, where e is tiny and decides the largest scores (a GPU's approximate log of u there is off by up to
    100%)."""
    spread = torch.arange(2 ** 23, dtype=torch.int64) << 9 | 0x15A
    ends = torch.arange(2 ** 16, dtype=torch.int64)
    if device == "cpu":
        spread, ends = spread[::128], ends[:4096]
    words = torch.cat([ends, spread, 2 ** 32 - 1 - ends])
    exact = -torch.log((words.double() + 0.5) * 2.0 ** -32)
    got = torch.empty(len(words), dtype=torch.float32, device=device)
    _exponentials[(-(-len(words) // 1024),)](words.to(device), got, len(words), BLOCK=1024)
    for e in (got.cpu().double(), S.exponential(words).double()):
        assert float(((e - exact).abs() / exact).max()) < TOLERANCES["gumbel_exponential_rel"][1]


def test_the_kernels_layout_is_the_references():
    assert (K.QUARTER, K.CHUNK) == (S.QUARTER, S.CHUNK)


def _logits(rows, width, seed=0):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 7, 1024, 4096, 4097, 9000])
def test_kernel_tokens_are_the_references(device, width):
    x = _logits(6, width, width).to(device)
    for seed, temperature, rows, vocab in ((7, 1.0, None, width), (2 ** 62 - 1, 0.7, [5, 0, 3, 3, 1, 2], width),
                                           (0, 1.3, None, max(1, width - 3))):
        r = None if rows is None else torch.tensor(rows, device=device)
        got = K.gumbel_sample_triton(x, torch.tensor([seed], device=device), temperature, vocab, r)
        want = S.gumbel_sample_reference(x, seed, temperature, vocab, r)
        assert got.dtype == torch.int64 and torch.equal(got, want), (seed, temperature, rows)
        assert bool(((got >= 0) & (got < vocab)).all())


@pytest.mark.parametrize("device", DEVICES)
def test_infinities_nan_and_logits_past_the_vocabulary(device):
    x = _logits(5, 5000, 1)
    x[0, 4321] = float("inf")  # +inf wins
    x[1] = float("-inf")
    x[1, 4100] = 0.0  # the one finite logit
    x[2] = float("nan")  # some token in the vocabulary
    x[3, 10] = x[3, 4500] = float("inf")  # equal scores: the lowest index
    x[4, 4990:] = 1e30  # past vocab_size 4990: never drawn
    x = x.to(device)
    seed = torch.tensor([99], device=device)
    got = K.gumbel_sample_triton(x, seed, 1.0, 4990)
    assert got[:4].tolist() == [4321, 4100, 0, 10] and got[4] < 4990
    assert torch.equal(got, S.gumbel_sample_reference(x, 99, 1.0, 4990))
    assert torch.equal(got, K.gumbel_sample_triton(x[:, :4990].contiguous(), seed, 1.0, 4990))  # as if cut there
    strided = torch.zeros(5, 3, 5000, device=device)
    strided[:, 1] = x  # rows of a [batch, positions, vocab] tensor, as an eager step's last logits are
    assert torch.equal(K.gumbel_sample_triton(strided[:, 1], seed, 1.0, 4990), got)


def _within_lse_fused(got, want, scale):
    atol, rtol = TOLERANCES["lse_fused"]
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(torch.isnan(want), torch.isnan(got))
    assert torch.equal(got[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)].to(got.dtype))
    err = (got.double() - want.double())[finite].abs()
    assert bool((err <= atol + rtol * scale.double()[finite]).all()), float(err.max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,vocab", [(1, 1), (4096, 4096), (8200, 8190), (9000, 8990), (20000, 20000)])
def test_the_samplers_log_sum_exp(device, width, vocab):
    """lse: each row's log-sum-exp over all `width` logits (past vocab_size too, as log_softmax reads them;
    untempered) within "lse_fused" of float64's, the tokens those of the pass without it; a NaN or +inf logit gives
    NaN, a row of -inf gives -inf (its log-probs NaN, as log_softmax's), -inf logits elsewhere count for nothing.
    The learner's `row_logsumexp` (temperature 1, no row ids) gives the same bits as a rollout's pass at another
    temperature over a compacted batch's rows: on the GPU, other specialisations of the kernel."""
    from minite.ops.logprobs import row_logsumexp

    x = _logits(7, width, width) * 2
    if width >= 4096:
        x[1, 5] = float("nan")
        x[2, width - 1] = float("inf")
        x[3] = float("-inf")
        x[4, :4096] = float("-inf")  # a whole chunk of -inf: the row's other chunks decide
        x[5, 3] = 88.0  # exp overflows without the max
    x = x.to(device)
    seed = torch.tensor([31], device=device)
    for temperature, rows in ((1.0, None), (0.6, torch.tensor([6, 5, 4, 3, 2, 1, 0], device=device))):
        lse = torch.full((7,), 123.0, device=device)
        got = K.gumbel_sample_triton(x, seed, temperature, vocab, rows, lse=lse)
        assert torch.equal(got, K.gumbel_sample_triton(x, seed, temperature, vocab, rows))
        x64 = x.double()  # the docstring's m + log(s) in float64 (torch.logsumexp gives +inf for a +inf logit)
        m = x64.max(dim=-1, keepdim=True).values
        want = (m + torch.log(torch.exp(x64 - torch.where(m == float("-inf"), 0.0, m)).sum(-1, keepdim=True)))[:, 0]
        want[torch.isnan(x64).any(-1)] = float("nan")  # torch's max need not return a NaN
        _within_lse_fused(lse, want, want.abs())
        assert torch.allclose(row_logsumexp(x), lse, rtol=0, atol=0, equal_nan=True)  # bit for bit
        # bf16 logits (a CUDA-graph step's, decode.LOGITS_IN_PLACE) against the same values in fp32 (a learner's):
        # the same tokens and log-sum-exp bits (on the GPU: the two specialisations load 4 a thread alike)
        xb, lse_b, lse_f = x.bfloat16(), torch.empty_like(lse), torch.empty_like(lse)
        assert torch.equal(K.gumbel_sample_triton(xb, seed, temperature, vocab, rows, lse=lse_b),
                           K.gumbel_sample_triton(xb.float(), seed, temperature, vocab, rows, lse=lse_f))
        assert torch.allclose(lse_b, lse_f, rtol=0, atol=0, equal_nan=True)
        assert torch.allclose(row_logsumexp(xb.float()), lse_b, rtol=0, atol=0, equal_nan=True)
        logprobs = torch.gather(x, 1, got.view(-1, 1)).view(-1) - lse
        torch_lp = torch.log_softmax(x, dim=-1).gather(1, got.view(-1, 1)).view(-1)
        _within_lse_fused(logprobs, torch_lp, torch.maximum(lse.abs(), x.gather(1, got.view(-1, 1)).view(-1).abs()))
    with pytest.raises(ValueError, match=r"lse must be fp32 \[7\]"):
        K.gumbel_sample_triton(x, seed, 1.0, vocab, lse=torch.empty(6, device=device))
    if device == "cpu":
        with pytest.raises(ValueError, match="lse= is the Triton kernels'"):
            S.gumbel_sample(x, 1.0, torch.Generator(), vocab, lse=torch.empty(7))


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="unit stride"):
        K.gumbel_sample_triton(torch.zeros(4, 8).t(), torch.tensor([1]), 1.0, 4)
    with pytest.raises(ValueError, match="one int64"):
        K.gumbel_sample_triton(torch.zeros(4, 8), torch.tensor([1.0]), 1.0, 8)
    assert K.gumbel_sample_triton(torch.zeros(0, 8), torch.tensor([1]), 1.0, 8).shape == (0,)
    assert K.row_logsumexp_triton(torch.zeros(0, 8)).shape == (0,)
    with pytest.raises(ValueError, match="row_logsumexp: logits must be"):
        K.row_logsumexp_triton(torch.zeros(4, 8).t())
    x, gen = torch.zeros(4, 8), torch.Generator()
    for rows in (torch.tensor([0, 1, 2]), torch.tensor([0.0, 1, 2, 3]), torch.zeros(4, 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="one int32/int64 id per logits row"):
            S.gumbel_sample(x, 1.0, gen, 8, rows)
        with pytest.raises(ValueError, match="one int32/int64 id per logits row"):
            K.gumbel_sample_triton(x, torch.tensor([1]), 1.0, 8, rows)
    with pytest.raises(ValueError, match="nothing to sample from"):
        S.gumbel_sample(torch.zeros(4, 0), 1.0, gen, 8)
    with pytest.raises(ValueError, match="vocab >= 1"):
        K.gumbel_sample_triton(torch.zeros(4, 0), torch.tensor([1]), 1.0, 8)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        S.gumbel_sample(torch.zeros(8), 1.0, gen, 8)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax(temperature):
    """20,000 draws from one row of 6 logits (the reference: the kernels give its tokens, above): Pearson's
    chi-square against softmax(logits / T) under its 1e-6 quantile (tolerances.py). Drawing from softmax(-logits) or
    at a temperature 15% off lands far over it."""
    logits = torch.tensor([[1.0, -0.5, 2.0, 0.0, -1.0, 1.5]])
    n = 20_000
    gen = torch.Generator().manual_seed(int(temperature * 10))
    tokens = S.gumbel_sample(logits.expand(n, 6).contiguous(), temperature, gen, 6)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits[0].double() / temperature, 0) * n
    assert float(expected.min()) >= 5  # Pearson's approximation holds
    assert float(((counts - expected) ** 2 / expected).sum()) < TOLERANCES["chi_square_5_dof"][0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_draws_the_same_in_any_batch_and_the_generator_moves_on(device):
    x = _logits(8, 5000, 3).to(device)
    g1, g2 = (torch.Generator(device=device).manual_seed(4) for _ in range(2))
    whole = S.gumbel_sample(x, 1.0, g1, 5000)
    rows = torch.tensor([6, 2, 2, 0], device=device)  # a compacted batch: each row's id in the whole batch
    assert torch.equal(S.gumbel_sample(x[rows], 1.0, g2, 5000, rows), whole[rows])
    assert torch.equal(g1.get_state(), g2.get_state())  # one seed drawn either way
    again = S.gumbel_sample(x, 1.0, g1, 5000)
    assert not torch.equal(again, whole)  # the next step's seed: other draws (8 rows of 5000 words)
    assert torch.equal(S.gumbel_sample(x, 1.0, torch.Generator(device=device).manual_seed(4), 5000), whole)


@pytest.mark.gpu
def test_the_gpu_sampler_at_the_rollout_slices_vocabulary_without_a_host_synchronisation():
    x = _logits(64, 151936, 5).cuda()
    S.gumbel_sample(x, 1.0, torch.Generator(device="cuda"), 151936)  # compiled and launched once
    gen = torch.Generator(device="cuda").manual_seed(11)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = S.gumbel_sample(x, 1.0, gen, 151936)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seed = torch.randint(S.SEED_BOUND, (1,), dtype=torch.int64, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(11))
    assert torch.equal(got, S.gumbel_sample_reference(x, int(seed), 1.0, 151936))


def test_the_decoder_takes_gumbel_by_default_and_refuses_an_unknown_sampler():
    from minite.config import load_config
    from minite.rollout.decode import StaticBatchDecoder
    from minite.rollout.embedded import build_embedded

    tiny = ["model.num_layers=1", "model.hidden_size=64", "model.vocab_size=64", "model.num_experts=4",
            "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.max_position_embeddings=64"]
    assert build_embedded(load_config(None, tiny)).decoder.sampler == "gumbel"
    assert build_embedded(load_config(None, tiny + ["rollout.sampler=megatron"])).decoder.sampler == "megatron"
    with pytest.raises(ValueError, match="sampler must be one of gumbel, megatron, got 'multinomial'"):
        StaticBatchDecoder(torch.nn.Linear(1, 1), vocab_size=4, hidden_size=1, params_dtype=torch.float32,
                           sampler="multinomial")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("graphs", ["true", "false"])
def test_default_logprobs_from_the_samplers_lse_on_the_gpu(precision, graphs, monkeypatch):
    """`sampler_lse`'s GPU test (passed 2026-12-06 on an H100; fused.PROVEN since): a default-mode rollout's log-probs
    taken as logit - the sampler pass's log-sum-exp, compiled, against the same rollout's log-softmax ones: the same
    tokens (the sampler's pass draws the same), the log-probs within "lse_fused", the kernel asked for lse and the
    log-probs taken from it at every step; CUDA-graph replays (logits in the graphs' fp32 buffer) and eager steps (the
    model's output)."""
    from minite.rollout import decode
    from minite.config import load_config
    from minite.ops.logprobs import LSE_KERNEL
    from minite.rollout import SamplingParams
    from minite.rollout.embedded import build_embedded
    from minite.strict import fused

    vocab = 5000  # two chunks of 4096
    tiny = ["model.num_layers=2", "model.hidden_size=64", f"model.vocab_size={vocab}", "model.num_experts=8",
            "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.max_position_embeddings=64",
            f"precision.mode={precision}", f"rollout.cuda_graphs={graphs}"]
    engine = build_embedded(load_config(None, tiny))
    prompts, params = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_new_tokens=6, n=2, seed=3)
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {LSE_KERNEL})
    engine.generate(prompts, params)  # compiles and, with graphs, captures: the runs below replay
    base = engine.generate(prompts, params)
    asked, kernel, taken, at = [], K.gumbel_sample_triton, [], decode.logprobs_at
    monkeypatch.setattr(K, "gumbel_sample_triton", lambda *a, **k: asked.append(k.get("lse") is not None)
                        or kernel(*a, **k))
    monkeypatch.setattr(decode, "logprobs_at", lambda *a: taken.append(1) or at(*a))
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {LSE_KERNEL})
    got = engine.generate(prompts, params)
    assert len(asked) == (5 + params.max_new_tokens) - 3 and all(asked)  # a sample a position from the shortest prompt
    assert len(taken) == len(asked)
    assert engine.decoder.graphs > 0 if graphs == "true" else engine.decoder.graphs == 0
    for b, g in zip(base, got):
        assert b.tokens == g.tokens
        want, lp = torch.tensor(b.logprobs, dtype=torch.float64), torch.tensor(g.logprobs, dtype=torch.float64)
        # max(|lse|, |logit|) <= |log-prob| + log(V) + 10 for this tiny model's O(1) logits
        _within_lse_fused(lp, want, want.abs() + math.log(vocab) + 10)
