"""The `sglang` rollout backend: SGLang's offline Engine in-process, computing with the minite_nvfp4 plugin.

Start-up (`build_sglang(cfg)`): build the learner's initial model exactly as the learner does
(`minite.learner.model.build_model(cfg)`, so both start from the same weights), convert its tensors with
`minite.convert.export_nvfp4.pack_megatron_weights` into a ModelOpt-named NVFP4 checkpoint in a temporary directory
(config.json written from the model shape), and start `sglang.Engine(model_path=that, quantization="minite_nvfp4",
skip_tokenizer_init=True)`. SGLang runs the scheduler in a subprocess; the plugin registers there through its entry
point. Measured start-up on the 2-core CPU dev machine, tiny model: see docs/sglang.md. A BF16 learner
(precision.mode "bf16") gets a BF16 checkpoint under Hugging Face names, loaded without quantization, and BF16
weight updates. With cfg.alignment.strict, config.json carries `"minite_strict": true` and SGLang's Qwen3-MoE
computes with the learner's strict ops (minite.rollout.sglang.strict; torch_native attention, eager).

generate: one SGLang request per sample (n per prompt), token ids in, `return_logprob=True`; the per-token
log-probs are meta_info["output_token_logprobs"] (logprob, token id, text). They are the untempered policy's
(base.py's contract) because the engine runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1: SGLang then takes
log_softmax of the logits before temperature and top-p. Each sample gets `sampling_seed = derive_seed(seed, k)`.
SGLang honours sampling seeds only in its deterministic-inference mode (enable_deterministic_inference, on by default
here on GPU; SGLang measured it at about 34% slower, docs/upstream.md), which needs a GPU attention backend:
on CPU, sampling at temperature > 0 is therefore NOT reproducible call to call (greedy decoding is). Either way our
process's torch RNG is untouched (sampling happens in SGLang's scheduler process). The stop token ends a
response and is kept (SGLang's finished_len includes it); the config.json we write has no eos_token_id, so nothing
else stops a response early.

update_weights: the learner's Megatron-named tensors (tp=ep=pp=1 names; a leading "module." is ignored) are
validated (every expected name once, same shapes, finite floating point), then quantised with the learner's own
quantize_weight and packed (NVFP4 codes + E4M3 scales + FP32 global scales travel, about 4.5 bits per weight, not
BF16), renamed to SGLang's Qwen3-MoE checkpoint names, and sent with update_weights_from_tensor between
begin_weight_update() and end_weight_update() (end re-runs process_weights_after_loading). All-or-nothing: a
rejected tensor raises WeightUpdateError before anything is sent; if SGLang reports a failure half way, the engine
reloads the last good packed weights (kept on the host) and WeightUpdateError is raised.

Environment: the engine sets SGLANG_RETURN_ORIGINAL_LOGPROB=1 (and SGLANG_USE_CPU_ENGINE=1 without a GPU) for the
processes it starts; this is the launcher's job, done here because this class is the launcher. On a CPU-only
machine SGLang also needs stand-ins for two CUDA-only modules it imports (tests/rollout/sglang/stubs, put on PYTHONPATH);
they are test tooling and are not shipped.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from minite.convert.export_nvfp4 import exclude_modules, learner_to_hf, pack_megatron_weights, write_sharded
from minite.learner.model import build_model, model_shape
from minite.nvfp4.modelopt import quant_config_dict
from minite.ops import derive_seed
from minite.rollout.base import (
    RolloutEngine,
    RolloutResult,
    SamplingParams,
    WeightUpdateError,
    check_weights,
    strip_wrapper_prefix,
    truncate_at_stop,
)

from . import common
from .common import check_sglang_version
from .plugin import register

log = logging.getLogger(__name__)


class SGLangUnavailableError(RuntimeError):
    """SGLang (or a module it imports) cannot be imported; the message says how to install it."""


class SGLangEngineFailed(RuntimeError):
    """A process of the SGLang engine failed (its traceback is in the log); the engine is gone, this process is not."""


def _zmq_contexts() -> set:
    """The live ZMQ contexts of this process (a scan of the garbage collector's objects; only at engine starts)."""
    import gc

    import zmq
    return {o for o in gc.get_objects() if isinstance(o, zmq.Context)}


class _QuietCustomHandlerNotice(logging.Filter):
    """Drops SGLang's error-level notice that a custom SIGQUIT handler is in use (logged at every start)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "custom SIGQUIT handler" not in record.getMessage()


def import_sglang() -> None:
    """Import SGLang and the layer modules the plugin patches, or raise SGLangUnavailableError: run before the
    plugin registers (it imports them) so that a missing SGLang or dependency is one clear message."""
    try:
        import sglang  # noqa: F401
        import sglang.srt.layers.quantization  # noqa: F401
    except ImportError as e:
        raise SGLangUnavailableError(
            f"rollout.backend=sglang cannot import sglang ({e}): install it with `bash tools/setup.sh` "
            "(sglang==0.5.23 --no-deps plus tools/sglang_requirements.txt); on a CPU-only machine also put "
            "tests/rollout/sglang/stubs on PYTHONPATH (stand-ins for torchvision and sgl_kernel)") from e


def default_engine_args(device: str) -> dict:
    """sglang.Engine arguments for `device`; on CPU the ones found to work there (docs/upstream.md)."""
    args = {"skip_tokenizer_init": True, "dtype": "bfloat16", "log_level": "error",  # its warnings are start-up noise
            "quantization": "minite_nvfp4", "random_seed": 0}
    if device == "cpu":
        args.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                    sampling_backend="pytorch", mem_fraction_static=0.05, max_total_tokens=4096)
    else:
        args.update(enable_deterministic_inference=True)  # honours per-request sampling seeds (untested here)
    return args


class SGLangEngine(RolloutEngine):
    """SGLang offline Engine over a ModelOpt NVFP4 checkpoint, kept in sync with the learner (module docstring)."""

    def __init__(self, model_dir: str, *, hf_config: dict, recipe, expected: Dict[str, Tuple[int, ...]],
                 initial_packed: List[Tuple[str, torch.Tensor]], engine_args: Optional[dict] = None,
                 owns_dir: bool = False):

        import_sglang()
        check_sglang_version()
        register()  # in this process too: a failure here is raised, not just logged by SGLang's plugin loader
        device = "cuda" if torch.cuda.is_available() else "cpu"
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        if device == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        self.model_dir, self._owns_dir = model_dir, owns_dir
        self.hf_config, self.recipe, self._expected = hf_config, recipe, dict(expected)
        self._last_good = flatten_buckets(initial_packed)
        self.weight_version = 0
        self.last_update_seconds: Dict[str, float] = {}
        args = {**default_engine_args(device), **(engine_args or {})}
        self.engine_args = dict(args)
        t0 = time.perf_counter()
        self._failed: Optional[str] = None
        try:
            self.engine, self._sigquit_before = _start_engine(model_dir, args)
        except common.ChildFailedAtLaunch as e:
            raise SGLangEngineFailed(f"sglang rollout engine: {e}; nothing was started") from None
        atexit.register(self.shutdown)  # the scheduler process and the temporary checkpoint go even after an error
        _contain_child_failures(self)
        if common.FAILED_EARLY:  # a child failed between the start and the handlers above
            self._failed = common.CHILD_FAILED
        self.startup_seconds = time.perf_counter() - t0
        log.info("sglang engine ready in %.1f s (%s, quantization=%s)", self.startup_seconds, device,
                 args.get("quantization"))
        if not args.get("enable_deterministic_inference"):
            log.warning("sglang rollout: sampling seeds are ignored without deterministic inference (it needs a GPU "
                        "attention backend); sampled rollouts are not reproducible call to call")

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompts: List[List[int]], params: SamplingParams) -> List[RolloutResult]:

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompts")
        flat = [(i, [int(t) for t in p]) for i, p in enumerate(prompts) for _ in range(params.n)]
        sps = []
        for k in range(len(flat)):
            sp = {"temperature": float(params.temperature), "top_p": float(params.top_p), "top_k": -1,
                  "max_new_tokens": int(params.max_new_tokens), "sampling_seed": derive_seed(params.seed, k),
                  "no_stop_trim": True}
            if params.stop_token_id is not None:
                sp["stop_token_ids"] = [int(params.stop_token_id)]
            sps.append(sp)
        self._check_alive()
        try:
            outs = self.engine.generate(input_ids=[p for _, p in flat], sampling_params=sps, return_logprob=True)
        except Exception as e:  # noqa: BLE001 - a child's failure stops SGLang's event loop (_contain_child_failures)
            self._check_alive(e)
            raise
        results = []
        for (i, prompt), out in zip(flat, outs):
            toks = [int(t) for t in out["output_ids"]]
            lps = [float(lp) for lp, _tok, _txt in out["meta_info"]["output_token_logprobs"]]
            if len(lps) != len(toks):
                raise RuntimeError(f"sglang returned {len(toks)} tokens but {len(lps)} log-probs")
            toks, lps, finished = truncate_at_stop(toks, lps, params.stop_token_id)
            results.append(RolloutResult(prompt_index=i, prompt=prompt, tokens=toks, logprobs=lps,
                                         finished=finished))
        return results

    # ---- weight sync -----------------------------------------------------------------------------------------
    def validate(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        """The learner's tensors, checked against the model's names and shapes (`check_weights`); WeightUpdateError
        otherwise."""
        return list(check_weights(self._expected, named_tensors).items())

    send_from_gpu = True
    """Send the packed update from the learner's GPU (one CUDA IPC handle per bucket; the host copy a failed later
    update restores is made after the send, one device-to-host copy per bucket) instead of from host memory. H200,
    rollout slice (4 full-width layers), 2026-12-01 call 5 at 1b390e2: 3.76 s from the GPU (pack 0.67, load 0.76,
    host copy 2.28 tensor by tensor, now one copy per bucket) against 16.9 s from the host (pack 3.2, load 13.7)."""

    def pack(self, named: List[Tuple[str, torch.Tensor]], device: str = "cpu") -> List[Tuple[str, torch.Tensor]]:
        return pack_for_sglang(named, self.hf_config, self.recipe, device=device)

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        named = self.validate(named_tensors)
        t1 = time.perf_counter()
        gpu = self.send_from_gpu and bool(named) and named[0][1].is_cuda
        packed = self.pack(named, device=str(named[0][1].device) if gpu else "cpu")
        t2 = time.perf_counter()
        kept = []  # the host copy of each bucket once it is sent: one bucket at a time on the GPU
        self._check_alive()
        ok, msg = self._load(_keeping(iter_buckets(packed), kept))
        self._check_alive()  # a failed child leaves nothing to restore into
        if not ok:
            restored, rmsg = self._load(self._last_good)
            state = "kept its previous weights" if restored else f"could not restore its weights either ({rmsg})"
            raise WeightUpdateError(f"sglang rejected the weight update ({msg}); the engine {state}")
        self._last_good = kept
        self.weight_version += 1
        self.last_update_seconds = {"validate": t1 - t0, "pack": t2 - t1, "load": time.perf_counter() - t2}

    def _check_alive(self, cause: Optional[BaseException] = None) -> None:
        if self._failed is not None:
            raise SGLangEngineFailed(f"sglang rollout engine: {self._failed}; the engine is gone (restart the run, "
                                     "e.g. from its last checkpoint)") from cause

    def _load(self, buckets: Iterable) -> Tuple[bool, str]:
        """begin -> update_weights_from_tensor per bucket -> end; (success, message), never raises on errors SGLang
        returns or raises here (a failure inside its scheduler process ends the engine, and SGLang then ends this
        process). Once begun, the update session is always ended, so a restore or a later update can begin again.
        One bucket alive at a time: the reference to each is dropped before the next is made."""
        try:
            ok, msg = _result(self.engine.begin_weight_update())
            if not ok:
                return False, f"begin_weight_update: {msg}"
        except Exception as e:  # noqa: BLE001 - SGLang raises several types; the caller reports and restores
            return False, f"begin_weight_update: {type(e).__name__}: {e}"
        try:
            tp_size, it = int(self.engine_args.get("tp_size", 1)), iter(buckets)
            while ok:
                bucket = next(it, None)
                if bucket is None:
                    break
                payloads, bucket = bucket_payloads(bucket, tp_size), None
                ok, msg = _result(self.engine.update_weights_from_tensor(payloads, load_format="flattened_bucket",
                                                                         flush_cache=True))
                payloads = None
        except Exception as e:  # noqa: BLE001
            ok, msg = False, f"{type(e).__name__}: {e}"
        finally:
            end_ok, end_msg = False, "the engine failed"
            if self._failed is None:  # a failed engine answers nothing more
                try:
                    end_ok, end_msg = _result(self.engine.end_weight_update())
                except Exception as e:  # noqa: BLE001
                    end_ok, end_msg = False, f"{type(e).__name__}: {e}"
        if not ok:
            return False, msg
        return (True, msg) if end_ok else (False, f"end_weight_update: {end_msg}")

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        eng, self.engine = getattr(self, "engine", None), None
        if eng is not None:
            _shutdown_sparing_the_resource_tracker(eng)
            _restore_sigquit(getattr(self, "_sigquit_before", None))
        if self._owns_dir and self.model_dir and Path(self.model_dir).exists():
            shutil.rmtree(self.model_dir, ignore_errors=True)


def _contain_child_failures(owner: "SGLangEngine") -> None:
    """SGLang's scheduler and detokenizer signal this process (SIGQUIT) on any exception, and SGLang's handler then
    kills this whole process tree: the learner, its unsaved state and the reason with it (measured on the CPU engine:
    an update that SGLang's load_weights rejects ended the calling process with SIGKILL). Instead: mark the engine
    failed, end SGLang's remaining children (not the multiprocessing resource tracker) and stop the event loop the
    waiting call runs in, so that call raises and every later call raises SGLangEngineFailed in one line. SGLang
    installs its handler with the first request (TokenizerManager.auto_create_handle_loop, through
    `signal_handler_class`), or has already: both are replaced. Main thread only (as SGLang's own)."""
    import asyncio

    from sglang.srt.managers.tokenizer_manager import SignalHandler

    def on_child_failure(signum=None, frame=None):
        _mark_failed(owner)
        asyncio.get_event_loop().stop()

    class ContainedSignalHandler(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            on_child_failure(signum, frame)

    tm = getattr(owner.engine, "tokenizer_manager", None)
    if tm is None or threading.current_thread() is not threading.main_thread():
        return
    tm.signal_handler_class = ContainedSignalHandler
    if tm.event_loop is not None:
        tm.event_loop.add_signal_handler(signal.SIGQUIT, on_child_failure)
    else:  # until the first request installs the loop's handler: a failure marks the engine (never raises)
        signal.signal(signal.SIGQUIT, lambda signum, frame: _mark_failed(owner))


def _mark_failed(owner: "SGLangEngine") -> None:
    """A child failed while no call was waiting: the engine is failed (the next call raises), its processes end."""
    owner._failed = common.CHILD_FAILED
    log.error("sglang rollout engine: %s; ending its processes", owner._failed)
    common.end_sglang_children()


def _restore_sigquit(handler) -> None:
    """Put back the SIGQUIT handler that was there before the engine started (main thread only; a handler installed
    from C reads as None: the default then)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, signal.SIG_DFL if handler is None else handler)


def _shutdown_sparing_the_resource_tracker(eng) -> None:
    """eng.shutdown(), except that Python's multiprocessing resource tracker survives it. SGLang's shutdown SIGKILLs
    every child process of this one, the tracker included; the semaphores this process still holds then unregister
    at exit with a fresh tracker that never saw them, which prints a KeyError traceback after a successful run.
    SGLang's own atexit shutdown is dropped too: it would kill the tracker at exit."""
    import sglang.srt.entrypoints.engine as sgl_engine

    atexit.unregister(eng.shutdown)
    kill = sgl_engine.kill_process_tree
    sgl_engine.kill_process_tree = functools.partial(kill, skip_pid=common.resource_tracker_pid())
    try:
        eng.shutdown()
    finally:
        sgl_engine.kill_process_tree = kill


BUCKET_BYTES = 1 << 30
"""Bytes per flattened bucket of a weight update (one update_weights_from_tensor call each): a bucket is one extra
copy of its tensors on the sending device while it is sent."""


def _keeping(buckets, kept: list):
    """Yield each bucket; once it has been sent (the caller asks for the next), append its host copy to `kept` and
    drop the reference before the next bucket is made."""
    for flat, meta in buckets:
        yield flat, meta
        kept.append((flat.cpu(), meta))
        del flat


def flatten_buckets(packed: List[Tuple[str, torch.Tensor]], bucket_bytes: Optional[int] = None) -> list:
    """All of `iter_buckets` at once (the host copy kept for a restore; the tests)."""
    return list(iter_buckets(packed, bucket_bytes))


def iter_buckets(packed: List[Tuple[str, torch.Tensor]], bucket_bytes: Optional[int] = None):
    """The tensors as SGLang's `flattened_bucket` updates, made one at a time: (uint8 tensor, metadata), each the bytes of
    consecutive tensors (at most `bucket_bytes`, or one larger tensor alone) plus (name, shape, dtype, byte range) per
    tensor. So the transfer is one shared-memory segment (host) or one CUDA IPC handle (GPU) per bucket instead of
    one per tensor (an NVFP4 model has about four per expert and layer: ~6,000 for the 4-layer rollout slice).
    Widest dtypes first: every tensor then starts at a byte offset its dtype can be viewed at (SGLang rebuilds each
    as a view of the bucket). The metadata are SimpleNamespaces, which SGLang's restricted unpickler accepts (its own
    FlattenedTensorMetadata class it does not)."""
    from types import SimpleNamespace

    bucket_bytes = bucket_bytes or BUCKET_BYTES
    order = sorted(packed, key=lambda nt: -nt[1].element_size())
    groups, size = [[]], 0
    for name, t in order:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    for group in groups if groups[0] else []:
        flat, meta, offset = [], [], 0
        for name, t in group:
            b = t.contiguous().reshape(-1).view(torch.uint8)
            flat.append(b)
            meta.append(SimpleNamespace(name=name, shape=tuple(t.shape), dtype=t.dtype, start_idx=offset,
                                        end_idx=offset + b.numel(), numel=b.numel()))
            offset += b.numel()
        yield torch.cat(flat), meta


def bucket_payloads(bucket, tp_size: int) -> list:
    """One serialized `flattened_bucket` payload per TP rank (each rank deserializes its own: CUDA IPC refcounts)."""
    from sglang.srt.utils import MultiprocessingSerializer

    # CUDA tensors travel with torch's own reduction (a device index): the scheduler is this process's child and
    # numbers the GPUs alike. SGLang's monkey_patch_torch_reductions (device UUIDs) is not applied: once applied it
    # breaks the pickling of CPU tensors in this process (IndexError in its _modify_tuple), which restores use.
    flat, meta = bucket
    return [MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": meta}, output_str=True)
            for _ in range(tp_size)]


def pack_for_sglang(named, hf_config: dict, recipe, device: str = "cpu") -> List[Tuple[str, torch.Tensor]]:
    """Learner tensors -> SGLang-named tensors on `device` (the host by default): NVFP4 (uint8 codes, e4m3 scales,
    fp32 global scales) for the linears and experts, BF16 (the engine's dtype) for embeddings, norms, router and
    lm_head. recipe None (a BF16 learner): every tensor BF16 under its Hugging Face name."""

    out = []
    tensors = pack_megatron_weights(named, hf_config, recipe) if recipe is not None else learner_to_hf(named, hf_config)
    for name, t in tensors:
        if t.is_floating_point() and t.dim() > 0 and t.dtype != torch.float8_e4m3fn:
            t = t.to(torch.bfloat16)
        out.append((name, t.contiguous().to(device)))
    return out


def start_from_learner_tensors(named, hf_config: dict, recipe, *, engine_args: Optional[dict] = None,
                               strict: bool = False) -> "SGLangEngine":
    """Pack the learner's tensors into a temporary ModelOpt NVFP4 checkpoint (recipe None: a BF16 one, loaded
    without quantization) and start an engine on it (strict: config.json carries `minite_strict`, and SGLang computes
    with the learner's strict ops, minite.rollout.sglang.strict)."""
    hf_config = dict(hf_config)
    if strict:
        hf_config["minite_strict"] = True
    if recipe is None:
        engine_args = {**(engine_args or {}), "quantization": None}
    named = [(strip_wrapper_prefix(n), t.detach()) for n, t in named]
    expected = {n: tuple(t.shape) for n, t in named}
    packed = pack_for_sglang(named, hf_config, recipe)
    tmp = Path(tempfile.mkdtemp(prefix="minite-sglang-"))
    try:
        write_checkpoint(tmp, hf_config, packed, recipe)
        return SGLangEngine(str(tmp), hf_config=hf_config, recipe=recipe, expected=expected,
                            initial_packed=packed, engine_args=engine_args, owns_dir=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _result(r) -> Tuple[bool, str]:
    if isinstance(r, tuple) and len(r) >= 2:
        return bool(r[0]), str(r[1])
    if r is None:
        return True, ""
    return bool(getattr(r, "success", True)), str(getattr(r, "message", r))


def _start_engine(model_dir: str, args: dict):
    """(sglang.Engine, the SIGQUIT handler from before it) with the start's failures contained (common.
    launch_sigquit_handler; a failed start raises common.ChildFailedAtLaunch), keeping this process's logging: the Engine calls logging.basicConfig(force=True), which would
    replace the root handlers (the command's terminal filter and its log file, minite.console). Its scheduler
    process starts with PYTHONWARNINGS=ignore::UserWarning unless the variable is set: it imports Megatron-Core and
    SGLang's CUDA-only quantization modules, whose import-time UserWarnings would print on the terminal (this process
    sends its own to the run's log file); the variable is set only while the engine starts."""
    import sglang

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    warnings_env = os.environ.get("PYTHONWARNINGS")
    if warnings_env is None:
        os.environ["PYTHONWARNINGS"] = "ignore::UserWarning"
    main = threading.current_thread() is threading.main_thread()
    if main and args.get("custom_sigquit_handler") is None:
        args = {**args, "custom_sigquit_handler": common.launch_sigquit_handler}  # see its docstring
    quiet = _QuietCustomHandlerNotice()
    sgl_log = logging.getLogger("sglang.srt.entrypoints.engine")
    sgl_log.addFilter(quiet)
    before = _zmq_contexts()
    previous_sigquit = signal.getsignal(signal.SIGQUIT) if main else None
    common.FAILED_EARLY = False
    # Under torchrun the engine hung at its start (docs/sglang.md, "Under torchrun"): its scheduler process, which
    # inherits this environment, runs its own one-process torch.distributed group, and torch makes every rank a
    # client of the launcher's store when TORCHELASTIC_USE_AGENT_STORE is set (torchrun sets it for its workers):
    # the scheduler waited for a store server at its own port that nobody starts. So the variable is unset while the
    # engine starts. SGLang picks that port with Python's global `random` (random.sample over 22000-29999), which
    # every rank seeded alike (minite.rl.loop.setup), so two ranks of one machine would take the same port: the start
    # draws from this process's own entropy, and the run's random state is put back after it.
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rng_state = random.getstate()
    random.seed()
    try:
        eng = sglang.Engine(model_path=model_dir, **args)
    except BaseException:
        # a failed start: the half-built engine's ZMQ sockets (its tokenizer manager's) would block this process
        # forever when garbage-collected (zmq's term waits for messages to a dead peer), so they close now without
        # lingering; the start's raising handler goes
        for ctx in _zmq_contexts() - before:
            ctx.destroy(linger=0)
        _restore_sigquit(previous_sigquit)
        raise
    finally:
        random.setstate(rng_state)
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
        sgl_log.removeFilter(quiet)
        if warnings_env is None:
            os.environ.pop("PYTHONWARNINGS", None)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
    if main:  # the start's raising handler must not outlive it: failures now only mark (see SGLangEngine)
        signal.signal(signal.SIGQUIT, common.early_sigquit_handler)
    return eng, previous_sigquit


def write_checkpoint(out_dir: Path, hf_config: dict, packed: List[Tuple[str, torch.Tensor]], recipe) -> None:
    """config.json + hf_quant_config.json + safetensors of already packed tensors."""

    out_dir.mkdir(parents=True, exist_ok=True)
    write_sharded(out_dir, packed)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if recipe is None:  # BF16 checkpoint: no quantization config
        return
    qcfg = quant_config_dict(recipe, exclude_modules(hf_config))
    (out_dir / "hf_quant_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")


def build_sglang(cfg, *, pad_id: int = 0, engine_args: Optional[dict] = None) -> SGLangEngine:
    """An SGLang engine on the learner's initial weights (module docstring). pad_id is unused (no padding)."""

    import_sglang()  # before the model is built: a missing SGLang fails fast
    if (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.pp) != (1, 1, 1):
        raise ValueError("rollout.backend='sglang' takes weight updates from a tp=ep=pp=1 learner for now")
    args = engine_args_for(cfg, "cuda" if torch.cuda.is_available() else "cpu", engine_args)
    model = build_model(cfg, strict=bool(cfg.alignment.strict))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    recipe = cfg.precision.recipe if cfg.precision.mode == "nvfp4" else None
    return start_from_learner_tensors(named, model_shape(cfg).to_hf(), recipe,
                                      engine_args=args, strict=bool(cfg.alignment.strict))


def engine_args_for(cfg, device: str, extra: Optional[dict] = None) -> dict:
    """The engine arguments build_sglang adds to `default_engine_args(device)`: strict mode's on a GPU (SGLang's
    torch_native attention, whose per-request attention minite.rollout.sglang.strict replaces; eager, since the strict
    forward is not captured in CUDA graphs; torch sampling), then `rollout.sglang_args`, then `extra`. A strict run
    whose merged arguments ask for another attention backend (any `*attention_backend` key) or for graphs or
    compilation (`disable_cuda_graph` false, any `cuda_graph*` key, `enable_torch_compile`,
    `enable_piecewise_cuda_graph`) is refused here, in one line, rather than in SGLang's scheduler (whose failure
    would end this process)."""
    args = {}
    if cfg.alignment.strict and device != "cpu":
        args.update(attention_backend="torch_native", disable_cuda_graph=True, sampling_backend="pytorch",
                    enable_deterministic_inference=False)  # sampling is SGLang's own; the log-probs are strict
    args.update(cfg.rollout.sglang_args)
    args.update(extra or {})
    if cfg.alignment.strict:
        other = {k: v for k, v in args.items() if k.endswith("attention_backend") and v not in (None, "torch_native")}
        if other:
            raise ValueError("alignment.strict with rollout.backend='sglang' needs attention_backend='torch_native' "
                             f"(minite.rollout.sglang.strict replaces its attention), got {other}")
        graphs = sorted(k for k, v in args.items() if k.startswith("cuda_graph") or
                        (k in ("enable_torch_compile", "enable_piecewise_cuda_graph") and v))
        if not args.get("disable_cuda_graph", True) or graphs:
            raise ValueError("alignment.strict with rollout.backend='sglang' runs eagerly: disable_cuda_graph must "
                             f"stay true and no graph or compile arguments be given (got {graphs or 'disable_cuda_graph'})")
    return args
