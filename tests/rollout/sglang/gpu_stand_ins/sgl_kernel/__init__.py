"""GPU TEST STAND-IN for sgl_kernel, recording (tests/rollout/sglang/gpu_stand_ins/README.md). Never installed.

SGLang 0.5.23's CUDA path imports sgl_kernel (the `sglang-kernel` wheel, about 535 MB, built for torch 2.14) at
module level in several layers. This stand-in lets those imports succeed and says, per process, which names SGLang
took and which it called:
- every attribute and submodule (`sgl_kernel.utils`, `sgl_kernel.scalar_type`, ...) resolves; attribute chains are
  `_Missing` objects that raise `NotImplementedError("sgl_kernel.<name> ...")` when called;
- a few element-wise ops have pure-PyTorch bodies here (`TORCH_STAND_INS`: RMSNorm, gated activations, the top-k /
  top-p renormalisation of the sampler, `weak_ref_tensor` of the CUDA-graph runner), and
  `utils.is_arch_support_pdl()` is False (no programmatic dependent launch); they are for measuring how far the
  engine gets, not for serving;
- with MINITE_SGL_KERNEL_STANDIN_LOG set (test tooling sets it; this file is never imported by the library), each
  first `take` (import) and each first `call` of a name, per process, is appended to that file as a JSON line.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import torch

__version__ = "0.0.0+minite.gpu.stand.in"
_LOG = os.environ.get("MINITE_SGL_KERNEL_STANDIN_LOG")
_SEEN: set = set()


def _record(event: str, name: str) -> None:
    if (event, name) in _SEEN:
        return
    _SEEN.add((event, name))
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "name": name}) + "\n")


class _Missing:
    """A name the stand-in does not implement: attribute chains resolve, a call raises (and is recorded)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _record("call", self._name)
        raise NotImplementedError(f"sgl_kernel.{self._name} was called; sgl_kernel here is the GPU test stand-in "
                                  "(tests/rollout/sglang/gpu_stand_ins), which does not implement it")


def _recorded(fn, name):
    def wrapper(*args, **kwargs):
        _record("call", name)
        return fn(*args, **kwargs)
    wrapper.__name__ = name
    return wrapper


def _rms(x, weight, eps, gemma):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if gemma else weight.float()
    return (y * w).to(x.dtype)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    y = _rms(input, weight, eps, False)
    return y if out is None else out.copy_(y)


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    y = _rms(input, weight, eps, True)
    return y if out is None else out.copy_(y)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, False))


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, True))


def _gated(act):
    def op(input, out=None, enable_pdl=None):
        d = input.shape[-1] // 2
        y = act(input[..., :d].float()).mul(input[..., d:].float()).to(input.dtype)
        return y if out is None else out.copy_(y)
    return op


def top_k_renorm_prob(probs, top_k, *args, **kwargs):
    k = top_k if torch.is_tensor(top_k) else torch.full((probs.shape[0],), int(top_k), device=probs.device)
    sorted_p = probs.sort(dim=-1, descending=True).values
    kth = sorted_p.gather(-1, (k.long().clamp(1, probs.shape[-1]) - 1).view(-1, 1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_prob(probs, top_p, *args, **kwargs):
    p = top_p if torch.is_tensor(top_p) else torch.full((probs.shape[0],), float(top_p), device=probs.device)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) > p.view(-1, 1)
    kept = torch.zeros_like(probs).scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def weak_ref_tensor(tensor):
    """The real one aliases the storage without owning it (CUDA-graph outputs); this one is the tensor itself: the
    same values, only kept alive longer."""
    return tensor


TORCH_STAND_INS = {  # name -> pure-PyTorch body
    "rmsnorm": rmsnorm, "gemma_rmsnorm": gemma_rmsnorm, "fused_add_rmsnorm": fused_add_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
    "silu_and_mul": _gated(torch.nn.functional.silu),
    "gelu_and_mul": _gated(torch.nn.functional.gelu),
    "gelu_tanh_and_mul": _gated(lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    "top_k_renorm_prob": top_k_renorm_prob, "top_p_renorm_prob": top_p_renorm_prob,
    "weak_ref_tensor": weak_ref_tensor,
}
for _n in TORCH_STAND_INS:  # reached through __getattr__ only, so that taking one is recorded too
    globals().pop(_n, None)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    _record("take", name)
    if name in TORCH_STAND_INS:
        return _recorded(TORCH_STAND_INS[name], name)
    return _Missing(name)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any `sgl_kernel.<sub>` import gets a recording module (utils gets is_arch_support_pdl = False)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        sub = spec.name[len(__name__) + 1:]
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        _record("take", sub)

        def _attr(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            _record("take", f"{sub}.{attr}")
            return _Missing(f"{sub}.{attr}")

        mod.__getattr__ = _attr
        if sub == "utils":
            mod.is_arch_support_pdl = _recorded(lambda *a, **k: False, "utils.is_arch_support_pdl")
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
