"""The `embedded` rollout backend: Megatron-Core's model and static KV cache, in-process, sampled by miniTE's loop.

What runs: `minite.rollout.decode.StaticBatchDecoder` (the sampling loop) over Megatron's GPTInferenceWrapper with a
StaticInferenceContext (KV cache), on a GPTModel built by `minite.learner.model.build_model(cfg)`, so rollout and
learner run the same Megatron layers (BF16 or NVFP4). Prefill covers the shortest prompt, then one token per step
with the KV cache; log-probs are the log_softmax of the raw logits gathered at the sampled token, i.e. temperature 1
(base.py says why). A BF16 model is wrapped in Megatron's Float16Module so the logits reach log_softmax in fp32
(exact upcast of the bf16 logits), as in the learner; without it log_softmax would run in bf16 and the mismatch
metric would mostly measure that rounding. On a GPU each decode step is a CUDA graph (`cuda_graphs`,
cfg.rollout.cuda_graphs); `observed()` runs every step eagerly for Python hooks (op capture, route recording).

The loop (decode.py) computes what Megatron's TextGenerationController computes, bit for bit on the CPU, without
its host reads; `loop="megatron"` runs the controller itself (benchmarks, and the tests that compare the two). Why
not StaticInferenceEngine.generate either way: the engine's legacy path calls torch.random.manual_seed(1234) on
every generate (it would reset the RL loop's global RNG and break exact resume), adds a scheduler and a tqdm bar per
call, and does nothing else for a static batch. Both loops seed their own sampling generator per call, so the global
RNG is never touched.

Stopping: we pass no_early_termination and cut each response after its first stop token
ourselves, so the stop token itself (and its log-prob) is part of the response the learner trains
on; Megatron's own EOD handling drops the EOD token from the generated tokens. miniTE's loop looks for the stop token
every `stop_check_every` steps (cfg.rollout.stop_check_every): it stops once every response has ended and runs the
unfinished ones at a smaller batch until then (decode.py), so an RL rollout whose responses end at different lengths
does not pay for the finished ones.

CPU: besides the Megatron CPU patches the learner applies (minite.megatron_patches.cpu), the static
generate path calls torch.cuda.current_device(), torch.cuda.Event (timing) and Tensor.cuda() once;
`megatron_patches.cpu.cpu_generate_shims` maps those to the CPU for the duration of a generate call only,
and only when no GPU is present.

NaN/Inf: on a GPU the NVFP4 quantiser does not check its input on the spot (a host synchronisation per call); the
model's NVFP4 modules record into a device-side flag (`NVFP4Context.finite`), which generate reads once, after the
last step, and raises a one-line ValueError if a weight or activation was not finite. That catches what
quantisation would hide (an Inf saturates to a finite code, a NaN can round to code 0); a non-finite value that
reaches the logits (BF16 too) gives NaN log-probs, and generate raises a one-line ValueError for them after the
read-back (agreed over the ranks like the flag; the loop's sampler runs no validity check of its own, decode.py).
Megatron's controller (`loop="megatron"`) stops in torch.multinomial instead, whose CUDA kernel asserts on NaN.

MoE dispatch: with one EP and one TP rank the engine's MoE layers use `megatron_patches.moe_dispatch`'s
LocalTokenDispatcher instead of Megatron's alltoall dispatcher (three host synchronisations per layer and an E-way
split/cat on a GPU; the same rows and bits without them); `local_moe_dispatch=False` keeps Megatron's.

Strict mode is the engine's explicit setting (`strict`, from cfg.alignment.strict through build_model): the
model's ops are switched at build time, and the loop takes the strict log-softmax.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Iterable

import torch

from minite.learner.model import build_model, nvfp4_context
from minite.megatron_patches.cpu import cpu_generate_shims
from minite.megatron_patches.moe_dispatch import use_local_dispatch
from minite.megatron_patches.nvfp4_layers import CacheLayoutError, quantize_weights_now
from minite.megatron_patches.strict import controller_log_softmax
from minite.nvfp4 import NonFiniteError
from minite.ops import any_rank
from minite.rollout.decode import StaticBatchDecoder
from minite.rollout.base import (
    RolloutEngine,
    RolloutResult,
    SamplingParams,
    checked_weight_copy,
    strip_wrapper_prefix,
    truncate_at_stop,
)


logger = logging.getLogger(__name__)


class _EngineTokenizer:
    """The two members Megatron's controller uses. eod only pads: we never let it terminate."""

    def __init__(self, pad_id: int):
        self.eod = pad_id

    def detokenize(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)


class EmbeddedEngine(RolloutEngine):
    """Megatron-Core static inference over an in-process GPTModel (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int = 0, strict: bool = False, local_moe_dispatch: bool = True,
                 loop: str = "minite", cuda_graphs: bool = False, packed_weights: bool = False,
                 stop_check_every: int = 8, sampler: str = "gumbel"):
        from megatron.core.transformer.module import Float16Module
        from megatron.core.utils import get_model_config, unwrap_model

        if get_model_config(model).bf16 and not isinstance(model, Float16Module):
            model = Float16Module(get_model_config(model), model)  # fp32 logits, as the learner scores them
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # MoE layers on one rank dispatch without Megatron's alltoall dispatcher (no host synchronisation; same bits)
        self.local_moe_layers = use_local_dispatch(self.model) if local_moe_dispatch else 0
        self.config = get_model_config(model)
        self.vocab_size = unwrap_model(model).vocab_size
        self.pad_id = pad_id
        self.strict = strict
        self.nvfp4 = nvfp4_context(unwrap_model(model))
        if self.nvfp4 is not None:
            self.nvfp4.track_finite = True  # this engine reads the flag, once per generate
            if self.nvfp4.weight_values == packed_weights:  # the expert GEMMs read packed codes or fp16 block values
                self.nvfp4.weight_values = not packed_weights
                self.nvfp4.weights_updated()
        self._params = {strip_wrapper_prefix(n): p for n, p in model.named_parameters()}
        self.weight_version = 0
        self._graphs_generation = None if self.nvfp4 is None else self.nvfp4.generation
        if loop not in ("minite", "megatron"):
            raise ValueError(f"loop must be 'minite' or 'megatron', got {loop!r}")
        self.loop = loop
        self.decoder = StaticBatchDecoder(self.model, vocab_size=self.vocab_size, hidden_size=self.config.hidden_size,
                                          params_dtype=self.config.params_dtype, strict=strict,
                                          cuda_graphs=cuda_graphs, stop_check_every=stop_check_every,
                                          sampler=sampler)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutResult]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompts")
        flat = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        if self.loop == "minite":
            self._drop_stale_graphs()
            device = next(self.model.parameters()).device
            rng = torch.Generator(device=device)
            rng.manual_seed(params.seed)
            with cpu_generate_shims():
                out = self.decoder.generate([p for _, p in flat], max_new_tokens=params.max_new_tokens,
                                            temperature=float(params.temperature), top_p=float(params.top_p),
                                            generator=rng, pad_id=self.pad_id, device=device,
                                            stop_token_id=params.stop_token_id, group=_world_group())
            tokens, logprobs, finite = out.tokens, out.logprobs, out.finite
        else:
            with cpu_generate_shims(), controller_log_softmax(self.strict):
                controller = self._controller(len(flat), max(len(p) for _, p in flat) + params.max_new_tokens)
                controller.sampling_rng.manual_seed(params.seed)
                done = controller.generate_all_output_tokens_static_batch(self._requests(flat, params))
            tokens = [req.generated_tokens.tolist() for req in done.values()]
            logprobs = [list(req.generated_log_probs) for req in done.values()]
        if self.nvfp4 is not None:
            # the GPU's deferred NaN/Inf check: one host read per call, agreed over the ranks (under EP or TP a rank
            # that alone saw a NaN must not raise while the others wait in the next collective)
            self.nvfp4.finite.check("generate", group=_world_group())
        if self.loop == "minite":  # after the flag's check, which names the cause more closely and resets the flag
            _check_finite_logprobs(finite, group=_world_group())
        results = []
        for (i, prompt), gen, lp in zip(flat, tokens, logprobs):
            toks, lps, finished = truncate_at_stop(gen, lp, params.stop_token_id)
            results.append(RolloutResult(prompt_index=i, prompt=prompt, tokens=toks, logprobs=lps, finished=finished))
        return results

    def _controller(self, batch: int, max_len: int):
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        iwc = InferenceWrapperConfig(
            hidden_size=self.config.hidden_size,
            params_dtype=self.config.params_dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=self.vocab_size,
            inference_max_requests=batch,
            inference_max_seq_length=max_len,
        )
        wrapper = GPTInferenceWrapper(self.model, iwc, StaticInferenceContext.from_config(iwc))
        return TextGenerationController(wrapper, _EngineTokenizer(self.pad_id))

    @staticmethod
    def _requests(flat: list[tuple[int, list[int]]], params: SamplingParams) -> OrderedDict:
        from megatron.core.inference.inference_request import InferenceRequest, Status
        from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

        sp = MegatronSampling(
            temperature=float(params.temperature),
            top_k=0,
            top_p=0.0 if params.top_p >= 1 else float(params.top_p),  # Megatron: 0 disables top-p
            return_log_probs=True,
            num_tokens_to_generate=params.max_new_tokens,
        )
        sp.add_attributes({"no_early_termination": True})
        reqs = OrderedDict()
        for k, (_, prompt) in enumerate(flat):
            reqs[str(k)] = InferenceRequest(
                request_id=str(k),
                prompt="",
                sampling_params=sp,
                prompt_tokens=list(prompt),
                status=Status.ACTIVE_BUT_NOT_GENERATING_TOKENS,
            )
        return reqs

    @contextlib.contextmanager
    def observed(self):
        """While open, Python forward hooks see every step (op capture, route recording): no CUDA-graph replays, and
        prefill materialises every prompt position's logits as Megatron's controller does, and every row runs to
        max_new_tokens (no stop, no compaction), so captured rows line up with the learner's full-sequence forward.
        The same tokens and log-probs either way on the CPU and in strict mode (in default mode on a GPU the
        prefill's lm_head GEMM then has more rows: decode.py's docstring)."""
        d = self.decoder
        saved = (d.cuda_graphs, d.prefill_all_logits, d.stop_check_every)
        d.cuda_graphs, d.prefill_all_logits, d.stop_check_every = False, True, 0
        try:
            yield self
        finally:
            d.cuda_graphs, d.prefill_all_logits, d.stop_check_every = saved

    def _drop_stale_graphs(self) -> None:
        """A CUDA graph replays the quantised-weight caches it captured, at their addresses. `update_weights` refills
        them in place; a write that bypasses it and calls `nvfp4.weights_updated()` makes the next forward build new
        caches, which no graph would see (and the old ones are freed under it): the graphs are captured again. Not
        covered: a `param.copy_` outside update_weights without weights_updated() (the caches' keys see its version
        counter, this check does not): weights go through update_weights."""
        generation = None if self.nvfp4 is None else self.nvfp4.generation
        if generation != self._graphs_generation and self.decoder.graphs:
            self.decoder.reset_graphs()
        self._graphs_generation = generation

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checked copy of the learner's tensors, then the NVFP4 re-quantisation of every weight (eager, so a weight
        sync costs what it costs and the next rollout's first step does not pay for it)."""
        checked_weight_copy(self._params, named_tensors)
        # in place while decode graphs hold the caches' addresses (they replay whatever is there)
        if self.decoder.graphs:
            try:
                quantize_weights_now(self.model, in_place=True)
            except CacheLayoutError as e:  # a cache the graphs cannot see updated: capture them again
                logger.warning("%s; the rollout's CUDA graphs are captured again", e)
                self.decoder.reset()
        else:
            quantize_weights_now(self.model)
        self.weight_version += 1

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._params.items())


def _check_finite_logprobs(finite: bool, group=None) -> None:
    """One-line NonFiniteError (a ValueError) unless every log-prob of the generate was finite (`Decoded.finite`),
    which finite logits always give (log_softmax of finite values is finite): else the model's logits were not. With
    `group`, raised on every rank if on any (a collective each rank calls once per generate)."""
    bad = not finite
    if group is not None:
        bad = any_rank(bad, group)
    if bad:
        raise NonFiniteError("NaN or Inf in the logits during generate (a weight or activation of the model is not "
                             "finite)")


def _world_group():
    """The default process group when several ranks run the engine together, else None."""
    import torch.distributed as dist
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def build_embedded(cfg, *, pad_id: int = 0) -> EmbeddedEngine:
    """An embedded engine over a fresh `build_model(cfg)` (the learner's layers, its own weights)."""
    strict = bool(cfg.alignment.strict)
    return EmbeddedEngine(build_model(cfg, strict=strict), pad_id=pad_id, strict=strict,
                          cuda_graphs=bool(cfg.rollout.cuda_graphs), packed_weights=bool(cfg.rollout.packed_weights),
                          stop_check_every=int(cfg.rollout.stop_check_every), sampler=cfg.rollout.sampler)
