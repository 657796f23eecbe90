"""The embedded engine's sampling loop: a static batch over a Megatron GPTModel and its KV cache.

    tokens = prompts, padded to the longest prompt + max_new_tokens
    prefill positions [0, shortest prompt)                     (one forward, Megatron's StaticInferenceContext)
    for q in shortest prompt .. last position:
        logits of position q - 1 -> sample a token for position q (`sampler`: Gumbel-max or Megatron's arithmetic)
        a row still inside its prompt keeps its prompt token; log p(token at q) = log_softmax(logits)[token]
            (default mode, Gumbel sampler, GPU: logit[token] - the sampler pass's log-sum-exp, minite.ops.logprobs)
        forward the token at q (one position, the KV cache grows by one)
        every stop_check_every steps, given a stop token: one host read of the rows that have sampled it; all of
        them -> stop; else the unfinished rows move to the batch's first rows and run alone (compaction, `_Slots`)
    one read-back of the tokens and log-probs

With sampler "megatron" it computes what Megatron-Core 0.16.1's TextGenerationController.generate_all_output_tokens_
static_batch computes for a static batch without early termination (the same forward calls through the same
GPTInferenceWrapper, the same sampling ops in the same order on the same generator, the same log-softmax, the same
sequence-parallel guard), tested bit for bit against it on the CPU (tests/rollout/test_decode.py). With "gumbel"
(the default, `rollout.sampler`) each step's tokens come from one pass over the logits (`minite.rollout.sampling`):
the same distribution and everything else the same, other tokens for a seed. With a stop token, each response up to
it, bit for bit where the forward is batch invariant (strict mode), since compaction changes the batch a step runs.
One difference can show on a GPU in default mode: prefill materialises the logits of the last prompt position only,
so the lm_head GEMM has batch rows where the controller's had batch x prompt rows, and cuBLAS may pick another
kernel for it (strict mode's linears are batch invariant; `observed()` in the engine restores the controller's full
prefill logits). What differs is the host side: the controller keeps the prompt lengths in a CUDA tensor, so every
context position and every "all done?" test is a device-to-host read (17 host synchronisations per decode step
measured on the H200, docs/benchmarks.md); here positions are Python ints and the only reads are the final tokens
and log-probs, and with a stop token one every `stop_check_every` steps. Prefill materialises the logits of the last
prompt position only (the controller materialises every prompt position's logits for prompt log-probs, which a
rollout does not return).

CUDA graphs (`cuda_graphs=True`, CUDA only): decode step q runs as a graph captured once for (batch, sequence
length, q) and replayed in every later generate of that shape. Each step's graph differs because Megatron's static
KV cache addresses positions with Python ints (the K/V write at q - 1, attention over [0, q)); an RL run
generates the same shape every step, so its first rollout captures and every later one replays. Replays read every
buffer at its captured address: the KV cache (kept between calls: one StaticInferenceContext per shape), the token
buffer, the model's weights (updated in place by the engine) and their NVFP4 caches (re-quantised in place when
graphs exist: `quantize_weights_now(model, in_place=True)`), and the RoPE tables: Megatron's (RotaryEmbedding's
lru_cache) and strict mode's sin/cos (`minite.strict.ops._ROPE_CACHE`) are caches that evict, so each shape keeps a
reference to every RoPE tensor its captures saw (the learner's many sequence lengths would otherwise evict the
engine's table and free what a graph reads). The graphs of one shape share one memory pool; a step's temporaries
are dead when it ends, and its logits, left in the model's dtype, are copied into one fp32 buffer allocated outside
the pool (the copy is Float16Module's upcast, exact), or, where the sampler reads the model's dtype
(`LOGITS_IN_PLACE`), written there by the lm_head itself. Sampling and the log-softmax stay eager (a few launches). A
capture that fails (a host synchronisation inside the forward, e.g. strict BF16's host-side expert counts) turns
graphs off for this decoder with one warning naming the error, and the step runs eagerly: the bits are the same
either way (a graph replays the kernels the eager step launches).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minite.ops import any_rank
from minite.ops.logprobs import LSE_KERNEL, lse_applies, logprobs_at
from minite.rollout.sampling import gumbel_sample
from minite.strict import fused, ops as S

logger = logging.getLogger(__name__)


@dataclass
class Decoded:
    """Per row of the flat batch: the max_new_tokens response tokens and their log-probs (host lists). With a stop
    token, what follows a row's first one is filler (samples, then pad_id with log-prob 0 after a compaction or an
    early stop): callers cut after the stop token (`minite.rollout.base.truncate_at_stop`)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finite: bool = True  # every log-prob the loop computed was finite (non-finite logits give NaN ones)


SAMPLERS = ("gumbel", "megatron")


def sample(last_logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
           vocab_size: int, rows: torch.Tensor | None = None, batch: int = 0, sampler: str = "megatron",
           lse: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of last_logits [B, V]. sampler "gumbel" with top_p = 1: `minite.rollout.sampling`'s one pass
    (the same distribution, other tokens for a generator state; the decoder passes its `sampler`, this function's
    default is Megatron's), which also fills `lse` where given. Otherwise Megatron-Core 0.16.1's `_torch_sampling_func`
    arithmetic for top_k = 0 (the same ops in the same order on the same generator, so the same tokens): temperature,
    then nucleus filtering with its shifted mask (top_p < 1), softmax, one multinomial draw, clamped into the
    vocabulary.
    last_logits is left as it is (the caller's log-softmax reads it): copied only where an op below works in place
    (a copy of [batch, vocab] fp32 costs ~20 us at batch 64 on the H200, every step).

    The draw is torch.multinomial's own one-sample path written out (ATen's `multinomial`: q ~ Exp(1) from the
    generator, argmax(p / q) per row): the same ops on the same generator, so the same tokens and the same generator
    state after (tests/rollout/test_decode.py; on the H200 too), without the validity checks multinomial runs
    first (a min/max and a per-row sum over [batch, vocab] and device asserts: ~50 us per step at batch 64 on the
    H200, and an assert ends the process). Non-finite logits are caught by the caller, from the log-probs.

    rows (a compacted batch, `StaticBatchDecoder.generate`): last_logits' row i is row rows[i] of a batch of `batch`
    rows; the draws are the whole batch's, row rows[i]'s taken, so a row samples what it would in the whole batch."""
    if sampler == "gumbel" and not 0.0 < top_p < 1.0:
        return gumbel_sample(last_logits, temperature, generator, vocab_size, rows, lse)
    logits = last_logits.clone() if temperature != 1.0 or 0.0 < top_p < 1.0 else last_logits
    if temperature != 1.0:
        logits.div_(temperature)
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        drop[:, 1:] = drop[:, :-1].clone()
        drop[..., 0] = 0
        logits.masked_fill_(drop.scatter(1, sorted_idx, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    if rows is None:
        q = torch.empty_like(probs).exponential_(1, generator=generator)
    else:
        q = probs.new_empty(batch, probs.shape[1]).exponential_(1, generator=generator)[rows]
    tokens = torch.div(probs, q, out=q).argmax(dim=-1)
    return torch.clamp(tokens, min=0, max=vocab_size - 1)


class StaticBatchDecoder:
    """The loop of the module docstring over `model` (a GPTModel, Float16Module-wrapped in BF16)."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, hidden_size: int, params_dtype: torch.dtype,
                 strict: bool = False, cuda_graphs: bool = False, stop_check_every: int = 8, sampler: str = "gumbel"):
        if stop_check_every < 0:
            raise ValueError(f"stop_check_every must be >= 0 (0: never look for stop tokens), got {stop_check_every}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self.sampler = sampler
        self.model = model
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.strict = strict
        self.cuda_graphs = cuda_graphs
        self.stop_check_every = stop_check_every  # decode steps between looks for finished rows (generate)
        self.graph_error: str | None = None  # why graphs were turned off, if they were
        self.prefill_all_logits = False  # materialise every prompt position's logits (op capture lines up rows)
        self.time_decode = False  # CUDA: time the decode steps with two events per generate (benchmarks)
        self.last_decode: tuple[float, int] | None = None  # (seconds, steps) of the last generate's decode steps
        self.captures = 0  # decode steps captured as graphs so far (a capture costs far more than a replay)
        self._shapes: OrderedDict[tuple[int, int], _Shape] = OrderedDict()  # newest last
        self._guarded = False  # Megatron's sequence-parallel guard ran on the model

    @property
    def graphs(self) -> int:
        """How many decode steps are held as captured graphs (all shapes)."""
        return sum(len(st.graphs) for st in self._shapes.values())

    def reset(self) -> None:
        """Drop the kept KV caches, token buffers and graphs (the next generate builds them again)."""
        self._shapes.clear()

    def _state(self, batch: int, seq_len: int, device) -> "_Shape":
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        key = (batch, seq_len)
        if key in self._shapes:
            self._shapes.move_to_end(key)
            return self._shapes[key]
        while len(self._shapes) >= KEPT_SHAPES:
            self._shapes.popitem(last=False)
        iwc = InferenceWrapperConfig(
            hidden_size=self.hidden_size,
            params_dtype=self.params_dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=self.vocab_size,
            inference_max_requests=batch,
            inference_max_seq_length=seq_len,
        )
        wrapper = GPTInferenceWrapper(self.model, iwc, StaticInferenceContext.from_config(iwc))
        tokens = torch.empty(batch, seq_len, dtype=torch.long, device=device)
        st = _Shape(wrapper=wrapper, tokens=tokens, inputs=wrapper.prep_inference_input(tokens))
        self._shapes[key] = st
        return st

    def _sampler_lse(self, logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
        """An fp32 [rows] buffer for the sampler to fill with each row's log-sum-exp (minite.ops.logprobs), or None
        where the log-probs take the log-softmax: strict mode, Megatron's sampler, top-p, the CPU, or not proven."""
        if self.strict or self.sampler != "gumbel" or 0.0 < top_p < 1.0 or not lse_applies(logits):
            return None
        return torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)

    def _token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """log_softmax(logits [B, V])[b, tokens[b]]: fp32 [B]. Default mode: Megatron's controller's ops (the whole
        log-softmax, then the gather), or given the sampler's `lse` the logit at the token minus it; strict:
        `S.token_log_softmax`, the strict log-softmax's bits at the tokens."""
        if self.strict:
            return S.token_log_softmax(logits, tokens)
        if lse is not None:
            return logprobs_at(logits, tokens, lse)
        lp = F.log_softmax(logits.unsqueeze(1), dim=-1).to(torch.float32)
        return torch.gather(lp, 2, tokens.view(-1, 1, 1)).view(-1)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 generator: torch.Generator, pad_id: int, device, stop_token_id: int | None = None,
                 group=None) -> Decoded:
        """stop_token_id (with `stop_check_every` > 0): every that many steps one host read of which rows have
        sampled it after their prompt; the loop ends once all have (under `group`, once all have on every rank:
        each rank runs the same steps, for the collectives of its layers), and otherwise, where that halves it at
        least, the batch is compacted to the smallest power of two that holds the unfinished rows (`_Slots`; under
        CUDA graphs only once `COMPACT_WITH_GRAPHS` is proven). A row's tokens and log-probs up to its stop token
        are those of the whole batch's run wherever the forward is batch invariant (strict mode); its draws are the
        whole batch's (`sample`)."""
        lengths = [len(p) for p in prompts]
        batch, shortest, longest = len(prompts), min(lengths), max(lengths)
        seq_len = longest + max_new_tokens
        st = self._state(batch, seq_len, device)
        wrapper, tokens, inputs = st.wrapper, st.tokens, st.inputs
        padded = torch.full((batch, seq_len), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        tokens.copy_(padded)  # one host-to-device copy
        lengths_dev = torch.tensor(lengths, dtype=torch.long).to(device)
        logprobs = torch.zeros(batch, seq_len - 1, dtype=torch.float32, device=device)

        wrapper.prep_model_for_inference()  # eval mode, KV offsets to 0 (the cache memory is kept)
        if not self._guarded:
            _sequence_parallel_guard(self.model)
            self._guarded = True
        ctx = wrapper.inference_context
        events = None
        if self.time_decode and tokens.is_cuda and seq_len - shortest > 1:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        slots = _Slots(batch, lengths_dev, stop_token_id if self.stop_check_every > 0 else None)
        q = shortest
        for q in range(shortest, seq_len):
            start = 0 if q == shortest else q - 1
            ctx.materialize_only_last_token_logits = not (self.prefill_all_logits and start == 0)
            last = self._step(st, start, q, slots.n)
            lse = self._sampler_lse(last, top_p)
            if lse is None and last.dtype != torch.float32:  # a graph's logits in place (LOGITS_IN_PLACE), read by
                last = last.float()  # an fp32 consumer (top-p, say): the upcast the graph would have made (exact)
            sampled = sample(last, temperature, top_p, generator, self.vocab_size, slots.rows, batch, self.sampler,
                             lse)
            started = slots.lengths <= q  # rows whose prompt ended: take the sample; the others keep their prompt
            cur = tokens[: slots.n]
            cur[:, q] = torch.where(started, sampled, cur[:, q])
            slots.record(q, cur[:, q], self._token_logprobs(last, cur[:, q], lse), started, logprobs)
            if q >= longest:  # every row is past its prompt
                ctx.enable_decode_mode()
            if events is not None and q == shortest:
                events[0].record()  # prefill and its sample done: decode steps from here
            if slots.stop is not None and q < seq_len - 1 and (q - shortest + 1) % self.stop_check_every == 0:
                alive = slots.alive(group)  # a host read (and a collective under group)
                if alive is None:
                    break
                if self._may_compact(st):
                    slots.compact(alive, st, tokens, ctx.sequence_len_offset)
        if events is not None:
            events[1].record()

        written = logprobs[:, shortest - 1: q]  # the columns the loop wrote (the others hold zeros)
        finite = torch.isfinite(written).all().view(1)
        out = slots.tokens if slots.tokens is not None else tokens
        toks, lps, ok = out.cpu().tolist(), logprobs.cpu().tolist(), finite.cpu().tolist()  # the one read-back
        if events is not None:  # complete: the read-back waited for the stream
            self.last_decode = (events[0].elapsed_time(events[1]) / 1e3, q - shortest)
        return Decoded(tokens=[toks[i][n: n + max_new_tokens] for i, n in enumerate(lengths)],
                       logprobs=[lps[i][n - 1: n - 1 + max_new_tokens] for i, n in enumerate(lengths)],
                       finite=bool(ok[0]))

    def _may_compact(self, st: "_Shape") -> bool:
        """Whether this generate's decode steps may run at a smaller batch: eager steps always; captured ones once
        compaction is proven under CUDA graphs on the GPU (`COMPACT_WITH_GRAPHS`)."""
        graphs = self.cuda_graphs and self.graph_error is None and st.tokens.is_cuda
        return COMPACT_WITH_GRAPHS in fused.PROVEN or not graphs

    def _step(self, st: "_Shape", start: int, end: int, n: int) -> torch.Tensor:
        """Forward positions [start, end) of the batch's first n rows (all of them until a compaction) and return the
        logits of position end - 1 [n, vocab]: fp32, or the model's dtype from a graph that writes them in place
        (`LOGITS_IN_PLACE`)."""
        decode = end - start == 1 and start > 0
        if decode and n in st.warm and self.cuda_graphs and self.graph_error is None and st.tokens.is_cuda:
            captured = st.graphs.get((n, end)) or self._capture(st, start, end, n)
            if captured is not None:
                graph, logits = captured
                graph.replay()
                st.wrapper.inference_context.increment_sequence_len_offset(end - start)
                return logits
        window = st.wrapper.get_batch_for_context_window(st.rows_inputs(n), start, end)
        logits = st.wrapper.run_one_forward_step(window)[:, -1, :]
        if decode:
            st.warm.add(n)
        return logits

    def _capture(self, st: "_Shape", start: int, end: int, n: int):
        """Capture decode step `end` of the first n rows (the KV offset is start): (the graph, the buffer its replays
        leave the logits in), or None (and graphs off) if the capture fails."""
        ctx = st.wrapper.inference_context
        offset = ctx.sequence_len_offset
        in_place = self._logits_in_place(st.wrapper)
        if (n, in_place) not in st.logits:  # fp32 (the upcast copy) or the model's dtype (written in place)
            st.logits[(n, in_place)] = torch.empty(n, self.vocab_size, device=st.tokens.device,
                                                   dtype=self.params_dtype if in_place else torch.float32)
        out = st.logits[(n, in_place)]
        if st.pool is None:
            st.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        window = st.wrapper.get_batch_for_context_window(st.rows_inputs(n), start, end)
        seen = []  # the RoPE tables the captured forward reads (module docstring)
        hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(out)) for m in self.model.modules()
                 if _is_rotary(m)]
        try:
            # thread_local: another thread's CUDA calls (NCCL's watchdog under several ranks) do not break the capture
            with torch.cuda.graph(graph, pool=st.pool, capture_error_mode="thread_local"):
                if in_place:
                    _last_logits_into(st.wrapper, window, out)
                else:
                    out.copy_(_last_logits_in_model_dtype(st.wrapper, window))
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from now on, said once
            self.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning("rollout CUDA graphs off, the decode step runs eagerly: capture failed (%s)",
                           self.graph_error)
            torch.cuda.synchronize()
            self.reset_graphs()
            ctx.sequence_len_offset = offset
            return None
        finally:
            for h in hooks:
                h.remove()
        ctx.sequence_len_offset = offset  # the captured forward advanced it; the replay's caller does
        for t in [*seen, *S._ROPE_CACHE]:
            st.keep.setdefault(id(t), t)
        st.graphs[(n, end)] = (graph, out)
        self.captures += 1
        return graph, out

    def _logits_in_place(self, wrapper) -> bool:
        """Whether a captured step's lm_head writes into the graph's buffer in the model's dtype (`LOGITS_IN_PLACE`):
        proven, default mode, the Gumbel sampler with its log-sum-exp proven (the readers of bf16 logits), and an
        output layer `_last_logits_into` can write through."""
        return (LOGITS_IN_PLACE in fused.PROVEN and LSE_KERNEL in fused.PROVEN and not self.strict
                and self.sampler == "gumbel" and _lm_head_writes_into(wrapper, self.params_dtype))

    def reset_graphs(self) -> None:
        """Drop every captured graph, and with them their memory pools: a pool whose graphs are all gone is released
        by torch's allocator, and a capture into its handle fails (an internal assert, "use_count > 0", seen on the
        H200 with torch 2.11), so the next capture of a shape opens a new one."""
        for st in self._shapes.values():
            st.graphs.clear()
            st.pool = None


LOGITS_IN_PLACE = "logits_in_place"
"""The name under which a captured default-mode decode step's lm_head writes its logits, in the model's dtype,
straight into the graph's buffer (`_last_logits_into`), and the Gumbel sampler and `logprobs_at` read them there:
the values of the fp32 copy (bf16 -> fp32 is exact) without the copy of [batch, vocab] (28.9 us at batch 64 on an
H100, session 37's profile), and half the sampler's reads. The sampler's Triton specialisation for bf16 logits loads
them in the fp32 one's layout (4 a thread: sm_90, compiled on the CPU), so its log-sum-exp sums in the same order.
Taken where the sampler's log-sum-exp applies (minite.ops.logprobs), and the name is in `minite.strict.fused.PROVEN`
(since tests/rollout/test_decode.py `test_logits_in_place_replay_the_eager_bits` passed on an H100, 2026-12-06); a
generate whose sampling reads fp32 (top-p) upcasts the buffer first."""


KEPT_SHAPES = 4
"""Batch shapes whose KV cache and graphs a decoder keeps (an RL run uses one; a benchmark alternates two)."""


@dataclass(eq=False)
class _Shape:
    """What a decoder keeps per (batch, sequence length): the wrapper and its KV cache, the token buffer and the
    wrapper's inputs over it (position ids), and the graphs (keyed by (rows, step): a compacted batch runs on the
    first rows of the same buffers; each with the buffer its replays leave the logits in), their pool and those
    output buffers (one per number of rows and `LOGITS_IN_PLACE` or not)."""

    wrapper: object
    tokens: torch.Tensor
    inputs: dict
    graphs: dict = field(default_factory=dict)
    pool: object = None
    logits: dict = field(default_factory=dict)
    warm: set = field(default_factory=set)  # row counts whose eager decode step ran here (lazy caches, compiled
    # kernels of that size exist, so a capture records launches only)
    keep: dict = field(default_factory=dict)  # RoPE tensors the graphs read, held so no cache eviction frees them

    def rows_inputs(self, n: int) -> dict:
        """The wrapper's inputs over the first n rows (views at fixed addresses: what a graph of n rows reads)."""
        if n == self.tokens.shape[0]:
            return self.inputs
        return {"tokens": self.tokens[:n], "position_ids": self.inputs["position_ids"][:n],
                "attention_mask": self.inputs["attention_mask"]}


COMPACT_WITH_GRAPHS = "compact_with_graphs"
"""The name under which a generate whose decode steps replay CUDA graphs compacts its batch (`_Slots`): once it is in
`minite.strict.fused.PROVEN`, as it is since tests/rollout/test_decode.py's GPU test of it (every response bitwise
the eager generate's, BF16 and NVFP4) passed on sm_90 on 2026-12-05. The graphs of the compacted rows are captured
and replayed as the whole batch's are. Without the name such a generate still stops when every row has finished,
and runs the unfinished ones at the whole batch's size."""


class _Slots:
    """The rows of a generate's batch as its decode steps run them (`StaticBatchDecoder.generate`): at first every
    row in its own slot; after a compaction the first n slots of the token buffer and of every layer's KV cache hold
    the unfinished rows (`rows`), the first `real` of them once each and the rest repeating the first (n, a power of
    two, bounds the shapes a graph is captured for), and the finished rows' tokens live in `tokens`. Megatron's
    static KV cache writes a forward of b rows into its first b rows, so a compacted step needs no other change."""

    def __init__(self, batch: int, lengths: torch.Tensor, stop: int | None):
        self.n, self.real = batch, batch
        self.lengths = lengths  # each slot's prompt length
        self.rows: torch.Tensor | None = None  # each slot's row of the batch, once compacted
        self.tokens: torch.Tensor | None = None  # [batch, seq_len]: every row's tokens, once compacted
        self.stop = stop
        self.done = None if stop is None else torch.zeros(batch, dtype=torch.bool, device=lengths.device)

    def record(self, q: int, sampled: torch.Tensor, logp: torch.Tensor, started: torch.Tensor,
               logprobs: torch.Tensor) -> None:
        """Step q's tokens (already in the slots' token buffer) and log-probs, written for the slots' rows."""
        if self.rows is None:
            logprobs[:, q - 1] = logp
        else:
            real = self.rows[: self.real]
            logprobs[real, q - 1] = logp[: self.real]
            self.tokens[real, q] = sampled[: self.real]
        if self.done is not None:
            self.done |= started & (sampled == self.stop)

    def alive(self, group=None) -> torch.Tensor | None:
        """The slots whose row has not sampled the stop token yet (a host read), or None when no row has any left
        here nor, under `group`, on any rank."""
        slots = (~self.done[: self.real]).nonzero().view(-1)
        left = slots.numel()
        if group is not None:
            left = any_rank(left > 0, group)
        return slots if left else None

    def compact(self, slots: torch.Tensor, st: _Shape, tokens: torch.Tensor, written: int) -> None:
        """Move the rows of `slots` to the first slots, when that halves the batch at least: the token buffer's rows
        and the first `written` positions of every layer's KV cache (a gather, then a copy into the first rows)."""
        real = slots.numel()
        n = 1 << max(0, real - 1).bit_length()  # the smallest power of two >= real (1 for none: a rank whose
        if n > self.n // 2:                       # rows have finished while another rank's have not)
            return
        pick = torch.cat([slots, slots[:1].expand(n - real)]) if real else slots.new_zeros(1)
        if self.tokens is None:
            self.tokens = tokens.clone()
        tokens[:n] = tokens[: self.n][pick]
        for key, value in st.wrapper.inference_context.key_value_memory_dict.values():
            for cache in (key, value):  # [sequence, batch, ...]
                cache[:written, :n] = cache[:written, : self.n][:, pick]
        self.rows = pick if self.rows is None else self.rows[pick]
        self.lengths, self.done = self.lengths[pick], self.done[pick]
        self.n, self.real = n, real


def _last_logits_in_model_dtype(wrapper, window: dict) -> torch.Tensor:
    """`wrapper.run_one_forward_step(window)[:, -1, :]` with the logits left in the model's dtype: the same forward
    call as the wrapper's (Megatron-Core 0.16.1's `forward_pass_without_pipeline_parallel`: the model on the window's
    tokens, positions and mask with the gathered output, then the KV offset advanced by the window), with
    Float16Module's fp32 upcast off. The caller's copy into its fp32 buffer is that upcast (bf16 -> fp32 is exact):
    one pass over [batch, vocab] instead of a cast and a copy (~27 + ~22 us per decode step at batch 64 on the H200).
    A model without Float16Module or a pipeline of several stages takes the wrapper's call."""
    if not _model_dtype_call(wrapper):
        return wrapper.run_one_forward_step(window)[:, -1, :]
    tokens = window["tokens"]
    logits = wrapper.model(tokens, window["position_ids"], window["attention_mask"],
                   inference_context=wrapper.inference_context, runtime_gather_output=True, fp32_output=False)
    wrapper.inference_context.increment_sequence_len_offset(tokens.size(1))
    return logits[:, -1, :]


def _model_dtype_call(wrapper) -> bool:
    """Whether `_last_logits_in_model_dtype` calls the model itself: a Float16Module in one pipeline stage (the
    wrapper's own test for its call)."""
    from megatron.core.inference.communication_utils import is_pipeline_first_stage, is_pipeline_last_stage
    from megatron.core.transformer.module import Float16Module

    return (isinstance(wrapper.model, Float16Module) and is_pipeline_first_stage(wrapper.pp_group)
            and is_pipeline_last_stage(wrapper.pp_group))


def _lm_head_writes_into(wrapper, dtype: torch.dtype) -> bool:
    """Whether `_last_logits_into` applies with a buffer of `dtype`: the model-dtype call of
    `_last_logits_in_model_dtype` (Float16Module, one pipeline stage) whose output layer is a ColumnParallelLinear
    computing a bare matmul (one tensor-parallel rank, no sequence parallelism, no bias added, no deferred embedding
    wgrad) of a weight in `dtype`."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not _model_dtype_call(wrapper):
        return False
    gpt = wrapper.model.module
    layer = getattr(gpt, "output_layer", None)
    if type(layer) is not ColumnParallelLinear:
        return False
    weight = layer.weight if layer.weight is not None else gpt.shared_embedding_or_output_weight()
    return (layer.tp_group.size() == 1 and not layer.sequence_parallel and weight.dtype == dtype
            and (layer.bias is None or layer.skip_bias_add) and not layer.config.defer_embedding_wgrad_compute
            and "_forward_impl" not in vars(layer))


def _last_logits_into(wrapper, window: dict, out: torch.Tensor) -> torch.Tensor:
    """`_last_logits_in_model_dtype` with the lm_head's product written into `out` [rows, V] (the model's dtype):
    Megatron-Core 0.16.1's linear forwards (LinearWithGradAccumulationAndAsyncCommunication, and
    linear_with_frozen_weight for frozen weights) compute torch.matmul(input, weight.t()) at one tensor-parallel rank
    without bias; here the same matmul is given `out` (viewed [1, rows, V], the decode step's [s, b, V]) as its
    output, through the layer's `_forward_impl` for the one call (`_lm_head_writes_into` says when). GPTModel's
    [s, b, V] -> [b, s, V] transpose of a one-position step is a view, so the logits are `out` itself; an input of
    another shape takes upstream's call, copied into `out`."""
    layer = wrapper.model.module.output_layer
    upstream = layer._forward_impl
    own = vars(layer).get("_forward_impl")  # an instance's own (none where `_lm_head_writes_into` said yes)

    def into(input, weight, *args, **kwargs):
        if (input.shape[:-1] != (1, out.shape[0]) or weight.shape[0] != out.shape[1] or kwargs.get("bias") is not None
                or input.dtype != out.dtype or weight.dtype != out.dtype):
            return upstream(input, weight, *args, **kwargs)
        return torch.matmul(input, weight.t(), out=out.view(1, *out.shape))

    layer._forward_impl = into
    try:
        logits = _last_logits_in_model_dtype(wrapper, window)
    finally:
        if own is None:
            del layer._forward_impl  # the class's method again
        else:
            layer._forward_impl = own
    if logits.data_ptr() != out.data_ptr() or logits.stride() != out.stride():
        if logits.dtype != out.dtype:  # never where `_lm_head_writes_into` said yes: no silent rounding
            raise RuntimeError(f"lm_head logits in {logits.dtype}, the graph's buffer in {out.dtype}")
        out.copy_(logits)
    return out


def _is_rotary(module) -> bool:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    return isinstance(module, RotaryEmbedding)


def _sequence_parallel_guard(model) -> None:
    """Megatron's controller's guard (which it runs before every static generate; the model's settings do not change
    between calls, so the decoder runs it before its first): with TP > 1 the model runs without sequence parallelism
    (a decode step has one position to split). Megatron does this for TP > 1 with EP > 1 and refuses EP = 1; with
    expert TP 1 (miniTE's layout) the MoE layers take the whole sequence either way (docs/upstream.md)."""
    from minite.megatron_patches.qwen3_moe import set_sequence_parallel
    set_sequence_parallel(model, False)
