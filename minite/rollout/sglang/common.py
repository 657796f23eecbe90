"""The SGLang-free half of the minite_nvfp4 plugin: version pin, names, the ModelOpt NVFP4 layout as SGLang holds it,
the recipe <-> hf_quant_config.json mapping, and the MoE forward the plugin's fused-MoE method runs.

Imported by the plugin's SGLang classes (methods.py), strict mode (strict.py) and the engine (engine.py); it never
imports SGLang at import time, so the version check can run before anything of SGLang's is touched. It also holds the
SIGQUIT handlers the engine passes to SGLang (light to import: SGLang pickles its arguments into its processes). plugin.py's docstring has the
design.
"""
from __future__ import annotations

import importlib.metadata
import logging
import multiprocessing.resource_tracker
import os
import signal

import torch

from minite.ops import nvfp4_grouped_linear, routed_experts
from minite.nvfp4 import NVFP4Recipe

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
METHOD_NAME = "minite_nvfp4"


class ChildFailedAtLaunch(Exception):
    """Raised in the main thread by `launch_sigquit_handler` while sglang.Engine waits for its processes."""


FAILED_EARLY = False
"""Set by `early_sigquit_handler`: a child of SGLang failed after the start, before the engine's own handlers."""


CHILD_FAILED = "an SGLang child process failed (its traceback is in the log above)"


def resource_tracker_pid():
    """The pid of Python's multiprocessing resource tracker (None if none runs): SGLang's process-tree kills spare it."""
    return getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)


def end_sglang_children() -> None:
    """SIGKILL this process's child processes (SGLang's scheduler and detokenizer; also any other child of the
    caller's), sparing Python's multiprocessing resource tracker."""
    from sglang.srt.utils import kill_process_tree

    kill_process_tree(os.getpid(), include_parent=False, skip_pid=resource_tracker_pid())


def early_sigquit_handler(signum=None, frame=None) -> None:
    """SIGQUIT after a start (until the engine installs its own handlers) or after a failed one: note the failure
    (FAILED_EARLY) and end the children; never raises (it could interrupt any code of the caller's)."""
    global FAILED_EARLY
    FAILED_EARLY = True
    log.error("sglang rollout engine: %s; ending its processes", CHILD_FAILED)
    end_sglang_children()


def launch_sigquit_handler(signum=None, frame=None) -> None:
    """SGLang's `custom_sigquit_handler` while the engine starts. A scheduler or detokenizer that fails during its
    start-up signals this process (SIGQUIT), and SGLang's own launch-phase handler kills the whole process tree
    (measured on the CPU engine: a checkpoint the scheduler could not load ended the caller with SIGKILL). Here:
    disarm (a second signal only notes the failure), end the children and raise in the main thread, where
    sglang.Engine is waiting for them, so that the start raises."""
    signal.signal(signal.SIGQUIT, early_sigquit_handler)
    end_sglang_children()
    raise ChildFailedAtLaunch("an SGLang child process failed while the engine started (its traceback is in the log "
                              "above)")


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version this plugin was written and tested against."""


def check_sglang_version() -> str:
    """The installed SGLang version; raises SGLangVersionError unless it is exactly SGLANG_VERSION."""
    try:
        have = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise SGLangVersionError(f"sglang is not installed; the minite_nvfp4 plugin needs sglang=={SGLANG_VERSION} "
                                 "(tools/setup.sh installs it with its CPU-safe requirements)") from e
    if have != SGLANG_VERSION:
        raise SGLangVersionError(f"minite_nvfp4 supports sglang=={SGLANG_VERSION} only (it names SGLang's internal "
                                 f"layer and loader classes), found sglang=={have}")
    return have


# --------------------------------------------------------------------------------------------------------------
# Recipe <-> quantization config
# --------------------------------------------------------------------------------------------------------------

def grouped_forward(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, recipe: NVFP4Recipe, backend: str = "auto", *,
                    strict: bool = False) -> torch.Tensor:
    """Routed NVFP4 SwiGLU experts on x [T, H] with top-k ids/weights [T, k], computed as the learner's MoE layer
    does (minite.ops.experts.routed_experts). w13 / w2: NVFP4Stack (`expert_stack`) or lists of per-expert
    NVFP4Tensors. strict: strict SiLU and the fixed-order combine (minite.ops.experts)."""
    weights = (w13, w2)

    def fc(a, i, counts):  # weight= is only read for its shape when weight_q is given (no quantisation happens)
        return nvfp4_grouped_linear(a, _shape_only(weights[i], x), counts, recipe, weight_q=weights[i],
                                    backend=backend)

    return routed_experts(x, topk_ids, topk_weights, len(w13), fc, strict=strict)


def _shape_only(ws, like: torch.Tensor) -> torch.Tensor:
    """A zero-storage [E, N, K] stand-in: nvfp4_grouped_linear reads only the weight's shape/dtype when weight_q
    is given."""
    n, k = ws[0].shape
    return like.new_zeros(()).expand(len(ws), n, k)
