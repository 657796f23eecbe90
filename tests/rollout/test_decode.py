"""minite.rollout.decode: the embedded engine's own sampling loop gives Megatron-Core's controller's tokens and
log-probs bit for bit with rollout.sampler megatron (BF16 and NVFP4, default and strict, prompts of different lengths,
groups, temperature and top-p; the Gumbel sampler itself: test_sampling.py), reads nothing back from the device
until the end, and (on a GPU) replays its CUDA graphs with the same bits as the eager steps, across generates and
weight updates."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.config import load_config
from minite.rollout import SamplingParams
from minite.rollout.embedded import build_embedded
from tests.tolerances import TOLERANCES

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64", "model.num_experts=8",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.max_position_embeddings=64", "rl.seed=5"]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
PARAMS = [SamplingParams(max_new_tokens=6, n=2, seed=3),
          SamplingParams(max_new_tokens=5, seed=4, temperature=0.7, top_p=0.9)]
aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.item.default, aten.equal.default, aten.is_nonzero.default}


def _engine(precision, strict, *extra):
    return build_embedded(load_config(None, TINY + [f"precision.mode={precision}",
                                                     f"alignment.strict={'true' if strict else 'false'}", *extra]))


def _run(engine, params, prompts=PROMPTS):
    return [(r.tokens, r.logprobs, r.finished) for r in engine.generate(prompts, params)]


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("strict", [False, True])
def test_same_bits_as_megatrons_controller(precision, strict):
    engine = _engine(precision, strict, "rollout.sampler=megatron")  # the controller's sampling ops
    for params in PARAMS:
        engine.loop = "minite"
        ours = _run(engine, params)
        engine.loop = "megatron"
        assert ours == _run(engine, params)
        assert all(len(t) == params.max_new_tokens for t, _, _ in ours)
    # a different batch shape after the first (the decoder keeps one KV cache per shape)
    engine.loop = "minite"
    short = _run(engine, PARAMS[0], [[7, 8]])
    engine.loop = "megatron"
    assert short == _run(engine, PARAMS[0], [[7, 8]])


def test_stop_token_and_reproducibility():
    engine = _engine("nvfp4", False)
    free = _run(engine, PARAMS[0])
    stop = free[0][0][1]  # the second token of the first response
    cut = _run(engine, SamplingParams(max_new_tokens=6, n=2, seed=3, stop_token_id=stop))
    assert cut[0] == (free[0][0][:2], free[0][1][:2], True)
    assert _run(engine, PARAMS[0]) == free  # the same seed, the same tokens
    assert _run(engine, SamplingParams(max_new_tokens=6, n=2, seed=4)) != free


def _sample_equals_multinomial(device):
    from minite.rollout.decode import sample

    logits = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0)).to(device) * 4
    logits[3, 100:] = -float("inf")  # a row with zero-probability entries
    logits[5] = 0.0  # a uniform row
    for seed in range(20):
        for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.9)):
            ours_gen = torch.Generator(device=device).manual_seed(seed)
            ours = sample(logits, temperature, top_p, ours_gen, 1000)
            theirs_gen = torch.Generator(device=device).manual_seed(seed)
            x = logits / temperature if temperature != 1.0 else logits.clone()
            if top_p < 1.0:  # Megatron's nucleus mask, as sample() applies it
                sorted_logits, sorted_idx = torch.sort(x, descending=True)
                drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
                drop[:, 1:] = drop[:, :-1].clone()
                drop[..., 0] = 0
                x.masked_fill_(drop.scatter(1, sorted_idx, drop), float("-inf"))
            theirs = torch.multinomial(x.softmax(dim=-1), num_samples=1, generator=theirs_gen).view(-1)
            assert torch.equal(ours, theirs), (seed, temperature, top_p)
            assert torch.equal(ours_gen.get_state(), theirs_gen.get_state())  # the same draws consumed


def test_sample_draws_multinomials_tokens():
    """sample() writes torch.multinomial's one-sample path out (without its validity checks): the same tokens and
    the same generator state after, over seeds, temperatures, top-p, -inf entries and a uniform row."""
    _sample_equals_multinomial("cpu")


@pytest.mark.gpu
def test_sample_draws_multinomials_tokens_on_the_gpu():
    _sample_equals_multinomial("cuda")


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_non_finite_logits_stop_generate_with_one_line(precision):
    """A NaN that reaches the logits gives NaN log-probs; generate says so in one line (the sampler itself has no
    check), and the engine generates as before once the weights are finite again."""
    engine = _engine(precision, False)
    first = _run(engine, PARAMS[0])
    head = engine._params["output_layer.weight"]
    saved = head.data.clone()
    head.data[5, 3] = float("nan")
    if engine.nvfp4 is not None:
        engine.nvfp4.weights_updated()
    try:
        with pytest.raises(ValueError, match=r"^NaN or Inf in the logits during generate"):
            _run(engine, PARAMS[0])
    finally:
        head.data.copy_(saved)
        if engine.nvfp4 is not None:
            engine.nvfp4.weights_updated()
    assert _run(engine, PARAMS[0]) == first


def test_loop_reads_nothing_back_until_the_end():
    """BF16 (the NVFP4 quantiser checks its input on the CPU, a read the GPU defers to the end of generate)."""
    engine = _engine("bf16", False)
    with _HostReads() as reads:
        engine.generate(PROMPTS, PARAMS[0])
    assert reads.ops == []
    engine.loop = "megatron"
    with _HostReads() as reads:
        engine.generate(PROMPTS, PARAMS[0])
    assert len(reads.ops) > 10  # what the loop replaces: Megatron's controller reads per step


def test_bad_loop_name():
    from minite.learner.model import build_model
    from minite.rollout.embedded import EmbeddedEngine
    with pytest.raises(ValueError, match="loop must be"):
        EmbeddedEngine(build_model(load_config(None, TINY), strict=False), loop="hf")


def test_in_place_requantisation_keeps_addresses_and_gives_fresh_bits():
    from minite.megatron_patches.nvfp4_layers import quantize_weights_now
    engine = _engine("nvfp4", False)
    with pytest.raises(RuntimeError, match="cannot be updated in place"):
        quantize_weights_now(engine.model, in_place=True)  # no cache yet
    new = [(n, p.detach() * 0.5 + 0.01) for n, p in engine.named_weights()]
    engine.update_weights(new)  # no graphs: fresh caches
    fresh = {k: [t.clone() for t in v] for k, v in _caches(engine.model).items()}
    held = {k: [t.data_ptr() for t in v] for k, v in _caches(engine.model).items()}

    def write(scale):  # the parameters change under the caches (their version counters move)
        with torch.no_grad():
            for (_, p), (_, w) in zip(engine.named_weights(), new):
                p.copy_(w * scale)
        return quantize_weights_now(engine.model, in_place=True)

    assert write(2.0) == len(held)
    doubled = _caches(engine.model)
    assert any(not torch.equal(a, b) for k, v in doubled.items() for a, b in zip(v, fresh[k]))
    write(1.0)
    for k, v in _caches(engine.model).items():
        assert [t.data_ptr() for t in v] == held[k]  # the addresses a graph holds
        assert all(torch.equal(a, b) for a, b in zip(v, fresh[k]))  # the bits a fresh quantisation gives


def test_in_place_requantisation_of_caches_made_inside_a_generate():
    """Caches first made by a generate's forward (under inference mode) are inference tensors; the in-place update
    still writes them (and keeps their addresses)."""
    from minite.megatron_patches.nvfp4_layers import quantize_weights_now
    engine = _engine("nvfp4", False)
    engine.generate(PROMPTS, PARAMS[0])  # the caches are made lazily here
    held = {k: [t.data_ptr() for t in v] for k, v in _caches(engine.model).items()}
    assert held and all(t.is_inference() for v in _caches(engine.model).values() for t in v)
    with torch.no_grad():
        for _, p in engine.named_weights():
            p.mul_(0.5)
    assert quantize_weights_now(engine.model, in_place=True) == len(held)
    assert {k: [t.data_ptr() for t in v] for k, v in _caches(engine.model).items()} == held
    fresh = _engine("nvfp4", False)
    fresh.update_weights(engine.named_weights())
    got = [t for v in _caches(engine.model).values() for t in v]  # module order: the same in both models
    want = [t for v in _caches(fresh.model).values() for t in v]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def _caches(model):
    from minite.ops.common import _leaves
    return {(id(m), n): [t for t in _leaves(v[1]) if torch.is_tensor(t)]
            for m in model.modules() for n, v in vars(m).items() if n.startswith("_nvfp4_wq_cache_")}


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_captured_step_keeps_the_logits_in_the_model_dtype(precision):
    """The forward a decode graph captures (`_last_logits_in_model_dtype`) gives the model-dtype logits whose fp32
    upcast is the wrapper's `run_one_forward_step` output bit for bit, and advances the KV offset as that call does;
    a model outside Float16Module takes the wrapper's call."""
    from minite.rollout.decode import _last_logits_in_model_dtype
    engine = _engine(precision, False)
    _run(engine, PARAMS[0])  # the weights' caches made as a generate makes them
    with torch.inference_mode():  # as in generate: the KV cache is an inference tensor
        st = engine.decoder._state(2, 8, next(engine.model.parameters()).device)
        st.tokens.copy_(torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(st.tokens.device))
        bare = type(st.wrapper)(st.wrapper.model.module, st.wrapper.inference_wrapper_config,
                                st.wrapper.inference_context)
        outs = []
        for wrapper, run in ((st.wrapper, lambda w, win: w.run_one_forward_step(win)[:, -1, :]),
                             (st.wrapper, _last_logits_in_model_dtype),
                             (bare, lambda w, win: w.run_one_forward_step(win)[:, -1, :]),
                             (bare, _last_logits_in_model_dtype)):
            wrapper.prep_model_for_inference()
            outs.append((run(wrapper, wrapper.get_batch_for_context_window(st.inputs, 0, 4)),
                         wrapper.inference_context.sequence_len_offset))
    (full, off_full), (half, off_half), (bare_ref, _), (bare_out, _) = outs
    assert full.dtype == torch.float32 and half.dtype == torch.bfloat16 and off_half == off_full == 4
    assert torch.equal(half.float(), full)
    # without Float16Module the wrapper's own call runs (a model that refused fp32_output= would raise here)
    assert bare_out.dtype == bare_ref.dtype == torch.bfloat16 and torch.equal(bare_out, bare_ref)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_lm_head_writes_the_logits_into_the_given_buffer(precision, monkeypatch):
    """`_last_logits_into` (LOGITS_IN_PLACE): the model-dtype logits of `_last_logits_in_model_dtype` bit for bit,
    written by the lm_head's matmul into the given buffer itself (no copy), the KV offset advanced the same, and the
    output layer's own forward back after the call; which decoders take it (`_logits_in_place`)."""
    from minite.ops.logprobs import LSE_KERNEL
    from minite.rollout import decode
    from minite.strict import fused
    engine = _engine(precision, False)
    _run(engine, PARAMS[0])
    layer = engine.model.module.output_layer
    with torch.inference_mode():
        st = engine.decoder._state(2, 8, next(engine.model.parameters()).device)
        st.tokens.copy_(torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(st.tokens.device))
        assert decode._lm_head_writes_into(st.wrapper, torch.bfloat16)
        assert not decode._lm_head_writes_into(st.wrapper, torch.float16)  # a buffer of another dtype: never
        outs, writes = [], []
        for into in (False, True):
            st.wrapper.prep_model_for_inference()
            window = st.wrapper.get_batch_for_context_window(st.inputs, 0, 4)
            decode._last_logits_in_model_dtype(st.wrapper, window)  # the prompt's positions, then one decode step
            window = st.wrapper.get_batch_for_context_window(st.inputs, 4, 5)
            if into:
                buf = torch.full((2, engine.decoder.vocab_size), float("nan"), dtype=torch.bfloat16,
                                 device=st.tokens.device)
                inner, real = [], decode._last_logits_in_model_dtype
                monkeypatch.setattr(torch, "matmul", lambda *a, _m=torch.matmul, **k: writes.append(
                    k.get("out") is not None) or _m(*a, **k))
                monkeypatch.setattr(decode, "_last_logits_in_model_dtype",
                                    lambda *a: inner.append(real(*a)) or inner[0])
                got = decode._last_logits_into(st.wrapper, window, buf)
                monkeypatch.undo()
                assert got is buf and writes.count(True) == 1  # the lm_head's, the one matmul given an output
                assert inner[0].data_ptr() == buf.data_ptr() and inner[0].stride() == buf.stride()  # not a copy
            else:
                got = decode._last_logits_in_model_dtype(st.wrapper, window).clone()
            outs.append((got, st.wrapper.inference_context.sequence_len_offset))
    (want, off_want), (got, off_got) = outs
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want) and off_got == off_want == 5
    assert "_forward_impl" not in vars(layer)
    strict_engine = _engine(precision, True)  # strict mode's lm_head is its own (an instance's _forward_impl)
    with torch.inference_mode():
        wrapper = strict_engine.decoder._state(2, 8, next(strict_engine.model.parameters()).device).wrapper
    assert not decode._lm_head_writes_into(wrapper, torch.bfloat16)
    for proven, strict, sampler, takes in ((set(), False, "gumbel", False), ({LSE_KERNEL}, False, "gumbel", False),
                                           ({decode.LOGITS_IN_PLACE, LSE_KERNEL}, False, "gumbel", True),
                                           ({decode.LOGITS_IN_PLACE, LSE_KERNEL}, True, "gumbel", False),
                                           ({decode.LOGITS_IN_PLACE, LSE_KERNEL}, False, "megatron", False)):
        monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {decode.LOGITS_IN_PLACE, LSE_KERNEL} | proven)
        monkeypatch.setattr(engine.decoder, "strict", strict)
        monkeypatch.setattr(engine.decoder, "sampler", sampler)
        assert engine.decoder._logits_in_place(st.wrapper) == takes, (proven, strict, sampler)
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_logits_in_place_replay_the_eager_bits(precision, monkeypatch):
    """`LOGITS_IN_PLACE`'s GPU test (passed 2026-12-06 on an H100; it put the name in fused.PROVEN): with the sampler's
    log-sum-exp proven, graphs whose lm_head writes bf16 logits into their buffer give the eager steps' tokens and
    log-probs bit for bit (the eager step's logits are the wrapper's fp32: the sampler's bf16 and fp32 launches sum in
    the same order), at temperature 1 and 0.7, and a top-p generate (PARAMS[1]) upcasts the buffer first; the buffers
    are bf16."""
    from minite.ops.logprobs import LSE_KERNEL
    from minite.rollout import decode
    from minite.strict import fused
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {LSE_KERNEL, decode.LOGITS_IN_PLACE})
    eager, graphed = _engine(precision, False, "rollout.cuda_graphs=false"), _engine(precision, False)
    graphed.update_weights(eager.named_weights())
    for params in (PARAMS + [SamplingParams(max_new_tokens=5, seed=5, temperature=0.7)]) * 2:
        assert _run(graphed, params) == _run(eager, params)
    assert graphed.decoder.graph_error is None and graphed.decoder.graphs > 0
    bufs = [t for st in graphed.decoder._shapes.values() for t in st.logits.values()]
    assert bufs and all(t.dtype == torch.bfloat16 for t in bufs)
    # compacted batches (looking for the stop token every step): graphs of the compacted rows against eager steps
    # that compact the same way (default mode is not batch invariant: the same batches on both sides)
    eager, graphed = (_engine(precision, False, *extra, "rollout.stop_check_every=1")
                      for extra in (["rollout.cuda_graphs=false"], []))
    graphed.update_weights(eager.named_weights())
    prompts = PROMPTS[:2]
    free = _run(eager, SamplingParams(max_new_tokens=12, n=2, seed=3), prompts)
    params = SamplingParams(max_new_tokens=12, n=2, seed=3, stop_token_id=_early_stop_token(free))
    for _ in range(2):
        assert _run(graphed, params, prompts) == _run(eager, params, prompts)
    sizes = {n for st in graphed.decoder._shapes.values() for n, _ in st.graphs}
    assert graphed.decoder.graph_error is None and min(sizes) < 4, sizes  # compacted steps ran as graphs


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("strict", [False, True])
def test_cuda_graphs_replay_the_eager_bits(precision, strict):
    """Graph replays equal the eager steps bit for bit, in the capturing generate, in later ones, and after weight
    updates (in-place re-quantisation); strict BF16 too since its experts read the counts on the device
    (triton_gemm.grouped_matmul_fixed_k; until 54142e5 capture failed there and the engine ran eagerly)."""
    eager, graphed = _engine(precision, strict, "rollout.cuda_graphs=false"), _engine(precision, strict)
    graphed.update_weights(eager.named_weights())
    for params in PARAMS * 2:
        assert _run(graphed, params) == _run(eager, params)
    assert graphed.decoder.graph_error is None and graphed.decoder.graphs > 0
    new = [(n, p.detach() * 0.9) for n, p in eager.named_weights()]
    for engine in (eager, graphed):
        engine.update_weights(new)
    assert _run(graphed, PARAMS[0]) == _run(eager, PARAMS[0])
    # the RoPE caches evict (Megatron's lru_cache of 32 tables, strict sin/cos of 4), as a learner's many sequence
    # lengths would make them: the graphs keep reading the tables they captured
    if graphed.decoder.graphs:
        assert any(st.keep for st in graphed.decoder._shapes.values())
    _churn_rope_caches(graphed.model)
    assert _run(graphed, PARAMS[0]) == _run(eager, PARAMS[0])
    print(f"{precision} strict={strict}: graphs {graphed.decoder.graphs}, error {graphed.decoder.graph_error}")


@pytest.mark.gpu
def test_cuda_graphs_follow_weights_written_outside_update_weights():
    """A write through .data followed by nvfp4.weights_updated() (not update_weights, which refills the caches in
    place) makes new quantised-weight caches that the captured graphs cannot see: the engine captures again (the old
    graphs' pool is released with them: a new one), and the graphed engine still gives the eager engine's bits."""
    eager, graphed = _engine("nvfp4", False, "rollout.cuda_graphs=false"), _engine("nvfp4", False)
    graphed.update_weights(eager.named_weights())
    assert _run(graphed, PARAMS[0]) == _run(eager, PARAMS[0]) and graphed.decoder.graphs > 0
    for engine in (eager, graphed):
        with torch.no_grad():
            for _, p in engine.named_weights():
                p.data.mul_(0.9)
        engine.nvfp4.weights_updated()
    assert _run(graphed, PARAMS[0]) == _run(eager, PARAMS[0])
    # captured again, into a new pool (eager steps would give the same bits, so the graphs are counted)
    assert graphed.decoder.graph_error is None and graphed.decoder.graphs > 0


def test_stale_graphs_are_dropped_when_the_caches_are_made_anew():
    """The logic of the GPU test above, on the CPU (no graphs here: a stand-in shape holds one): a new cache
    generation drops the graphs before the next generate; in-place updates (update_weights) keep them."""
    from types import SimpleNamespace
    engine = _engine("nvfp4", False)
    _run(engine, PARAMS[0])  # the caches exist, as they do where graphs were captured (on a GPU, real ones)
    shape = SimpleNamespace(graphs={7: object()})
    engine.decoder._shapes["stand-in"] = shape
    held = engine.decoder.graphs
    engine.update_weights([(n, p.detach() * 0.9) for n, p in engine.named_weights()])
    engine._drop_stale_graphs()
    assert engine.decoder.graphs == held >= 1
    engine.nvfp4.weights_updated()
    engine._drop_stale_graphs()
    assert engine.decoder.graphs == 0
    del engine.decoder._shapes["stand-in"]


def test_observed_engine_runs_every_step_eagerly_with_the_same_bits():
    """Op capture and route recording need every step's Python hooks: observed() turns graphs off and materialises
    every prefill position's logits for its duration, then restores the settings; tokens and log-probs unchanged,
    bit for bit, except on a GPU the log-probs sampled from the prefill's logits (the first position of the shortest
    prompts' responses), whose lm_head GEMM has other rows there (cuBLAS; minite/rollout/decode.py): within
    observed_prefill_logprob_gpu."""
    engine = _engine("nvfp4", False)
    engine.decoder.cuda_graphs = True
    plain = _run(engine, PARAMS[0])
    calls = []
    hook = engine.model.module.output_layer.register_forward_hook(lambda m, i, o: calls.append(o[0].shape[0]))
    with engine.observed():
        assert engine.decoder.cuda_graphs is False and engine.decoder.prefill_all_logits is True
        seen = _run(engine, PARAMS[0])
    hook.remove()
    shortest = min(len(p) for p in PROMPTS)
    if next(engine.model.parameters()).is_cuda:
        from_prefill = [r for r, p in enumerate(p for p in PROMPTS for _ in range(PARAMS[0].n)) if len(p) == shortest]
        atol, _ = TOLERANCES["observed_prefill_logprob_gpu"]
        for r in from_prefill:
            assert abs(seen[r][1][0] - plain[r][1][0]) <= atol, _first_difference(seen, plain)
            seen[r][1][0] = plain[r][1][0]  # the rest of the comparison is bitwise
    assert seen == plain, _first_difference(seen, plain)
    assert engine.decoder.cuda_graphs is True and engine.decoder.prefill_all_logits is False
    assert calls[0] == shortest  # the prefill's logits cover every prompt position


@pytest.mark.gpu
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("width,dense", [((), False), (("model.hidden_size=128", "model.head_dim=32"), False),
                                         (("model.hidden_size=128", "model.head_dim=32"), True)])
def test_packed_weights_give_the_same_bits(strict, width, dense, monkeypatch):
    """rollout.packed_weights: the expert GEMMs read the weights' packed codes (in the decode order where K % 128 == 0)
    instead of fp16 block values (a quarter of the bytes); the decoded operands are the same numbers, so tokens and
    log-probs are the same bits. The dense linears whose K takes the decode order (at width 128) are packed too
    ("dense_packed", megatron_patches.nvfp4_layers.DENSE_PACKED_KERNEL, proven on an H100 on 2026-12-07 by this test
    and the op's); `dense` False: as if unproven, they keep their fp16 block values."""
    from minite.megatron_patches.nvfp4_layers import (DENSE_PACKED_KERNEL, GroupedExperts, NVFP4ColumnParallelLinear,
                                                      NVFP4RowParallelLinear)
    from minite.nvfp4 import NVFP4Stack, decode_order
    from minite.strict import fused
    if not dense:
        monkeypatch.setattr(fused, "PROVEN", fused.PROVEN - {DENSE_PACKED_KERNEL})
    values = _engine("nvfp4", strict, "rollout.packed_weights=false", *width)
    packed = _engine("nvfp4", strict, "rollout.packed_weights=true", *width)
    packed.update_weights(values.named_weights())
    for params in PARAMS:
        assert _run(packed, params) == _run(values, params)

    def caches(engine, kind):
        return [(m, v[1]) for m in engine.model.modules() if isinstance(m, kind)
                for n, v in vars(m).items() if n.startswith("_nvfp4_wq_cache_")]
    dense_kind = (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)
    experts, dense_caches = caches(packed, GroupedExperts), caches(packed, dense_kind)
    assert experts and dense_caches and all(w.values is None for _, w in experts)
    assert all((w.decode_data is not None) == (w.decode_scale is not None) == (w.shape[1] % 128 == 0)
               for _, w in experts)
    proven = DENSE_PACKED_KERNEL in fused.PROVEN
    assert all(isinstance(w, NVFP4Stack) == (proven and m.weight.shape[1] % 128 == 0) for m, w in dense_caches)
    assert all(w.values is not None for _, w in dense_caches if not isinstance(w, NVFP4Stack))
    assert all(w.values is None and torch.equal(w.decode_data, decode_order(w.data))
               for _, w in dense_caches if isinstance(w, NVFP4Stack))
    assert not width or not proven or any(isinstance(w, NVFP4Stack) for _, w in dense_caches)
    assert all(w.values is not None and getattr(w, "decode_data", None) is None
               for kind in (GroupedExperts, dense_kind) for _, w in caches(values, kind))


def _first_difference(got, want) -> str:
    """Where two `_run` results first differ: the response, the field and the position, with both values (on an H100
    it named the observed engine's first prefill-sampled log-prob, whose lm_head GEMM has other rows there)."""
    for r, (a, b) in enumerate(zip(got, want)):
        for name, x, y in zip(("tokens", "logprobs", "finished"), a, b):
            if x != y:
                if not isinstance(x, list):
                    return f"response {r}: {name} {x!r} != {y!r}"
                i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                return (f"response {r}: {name} first differ at position {i} of {len(x)}/{len(y)}: "
                        f"{x[i:i + 1]!r} != {y[i:i + 1]!r}")
    return f"{len(got)} responses against {len(want)}"


def _churn_rope_caches(model):
    """Evict every RoPE table the engine's graphs captured from its cache, free it, and write over freed memory."""
    from minite.rollout.decode import _is_rotary
    from minite.strict import ops as S
    for m in model.modules():
        if _is_rotary(m):
            for n in range(100, 140):  # > 32 new sequence lengths: the lru_cache drops the engine's table
                m(n)
    for n in range(6):  # > 4 new tables: strict sin/cos drop the engine's
        S._rope_sincos(torch.rand(50 + n, 1, 1, 8, device="cuda"))
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(64)]
    del junk


def _forward_rows(engine):
    """A list that gets the rows of every forward step the engine's decoder runs, eager or a CUDA-graph replay (a
    forward hook on the model would miss the replays: on the GPU it saw the prefill and the first step only)."""
    rows, step = [], engine.decoder._step

    def counted(st, start, end, n):
        rows.append(n)
        return step(st, start, end, n)

    engine.decoder._step = counted
    return rows


def _cut(responses, stop):
    """Each (tokens, logprobs, finished) cut after its first `stop` token, as the engine cuts."""
    out = []
    for toks, lps, _ in responses:
        n = toks.index(stop) + 1 if stop in toks else len(toks)
        out.append((toks[:n], lps[:n], stop in toks))
    return out


def _early_stop_token(responses):
    """The token that ends the most responses early (3 or more tokens before the end) and never comes in some (so the
    batch shrinks and runs on), of those preferably one that ends the first response (so the compaction moves a later
    row forward, not only drops the last ones); the smallest such id."""
    def early(t):
        at = [r[0].index(t) if t in r[0] else None for r in responses]
        ended = [a is not None and a < len(responses[0][0]) - 3 for a in at]
        return (-1, False) if None not in at else (sum(ended), ended[0])
    return max(sorted({t for r in responses for t in r[0]}), key=early)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_finished_responses_stop_costing_with_the_same_bits(precision):
    """Strict mode (batch invariant): looking for the stop token every step, the loop runs the unfinished responses
    at smaller batches (compaction) and each response is bit for bit the one of the run that never looks, cut at its
    stop token."""
    engine = _engine(precision, True, "rollout.stop_check_every=0")
    params = SamplingParams(max_new_tokens=12, n=2, seed=3)
    prompts = PROMPTS[:2]  # 4 rows of two prompt lengths; the stop token below ends 2 early: a batch of 2 runs on
    free = _run(engine, params, prompts)
    stop = _early_stop_token(free)
    want = _cut(free, stop)
    engine.decoder.stop_check_every = 1
    rows = _forward_rows(engine)
    got = _run(engine, SamplingParams(max_new_tokens=12, n=2, seed=3, stop_token_id=stop), prompts)
    assert got == want
    assert rows[0] == len(free) and min(rows) < len(free)  # prefill over the whole batch, later steps fewer rows
    assert all(n & (n - 1) == 0 for n in rows[rows.index(min(rows)):])  # compacted batches: powers of two


def test_the_loop_stops_once_every_response_has_ended():
    engine = _engine("bf16", False, "rollout.stop_check_every=1")
    params = SamplingParams(max_new_tokens=12, seed=3)
    engine.decoder.stop_check_every = 0
    free = _run(engine, params, [[1, 2, 3]])
    stop = free[0][0][2]  # the third token of the response
    engine.decoder.stop_check_every = 1
    rows = _forward_rows(engine)
    got = _run(engine, SamplingParams(max_new_tokens=12, seed=3, stop_token_id=stop), [[1, 2, 3]])
    assert got == _cut(free, stop) and got[0][2]
    assert len(rows) == free[0][0].index(stop) + 1  # prefill and one step per token after it, none more
    engine.decoder.stop_check_every = 4  # looked for every 4 steps: stops at the first look after the stop token
    rows.clear()
    assert _run(engine, SamplingParams(max_new_tokens=12, seed=3, stop_token_id=stop), [[1, 2, 3]]) == got
    assert len(rows) == 4


def test_stop_check_every_must_not_be_negative():
    with pytest.raises(ValueError, match=r"rollout: stop_check_every must be >= 0 .*, got -1"):
        load_config(None, TINY + ["rollout.stop_check_every=-1"])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_compaction_under_cuda_graphs_gives_the_eager_bits(precision, monkeypatch):
    """What put the compaction under CUDA graphs (`decode.COMPACT_WITH_GRAPHS`) into fused.PROVEN (it passed on
    2026-12-05): strict mode, looking for the stop token every step, the graphed engine compacts its batch (graphs of
    the compacted rows captured in the first generate, replayed in the second) and gives the bits of the eager run
    that never looks, cut at the stop token."""
    from minite.rollout import decode
    from minite.strict import fused

    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {decode.COMPACT_WITH_GRAPHS})
    eager = _engine(precision, True, "rollout.cuda_graphs=false", "rollout.stop_check_every=0")
    graphed = _engine(precision, True, "rollout.stop_check_every=1")
    graphed.update_weights(eager.named_weights())
    prompts = PROMPTS[:2]
    free = _run(eager, SamplingParams(max_new_tokens=12, n=2, seed=3), prompts)
    stop = _early_stop_token(free)
    params = SamplingParams(max_new_tokens=12, n=2, seed=3, stop_token_id=stop)
    for _ in range(2):
        assert _run(graphed, params, prompts) == _cut(free, stop)
    assert graphed.decoder.graph_error is None
    sizes = {n for st in graphed.decoder._shapes.values() for n, _ in st.graphs}
    assert min(sizes) < len(free), sizes  # steps of compacted batches ran as graphs
