"""Host-side helpers of the launchers: grid arithmetic on plain integers, the SM count, the launch itself.

An NVFP4 learner step on the H200 waits on its host (docs/benchmarks.md, issue 17), so the launchers' own host
work counts. Measured on the H200 machine's host (2026-12-02): `triton.cdiv` and `triton.next_power_of_2` cost
1.2 us per host call (in Triton 3.6 they are constexpr functions that unwrap their arguments on every call; a
linear's forward and backward call them ~30 times), `torch.cuda.get_device_properties` 4.1 us. The functions here
give the same integers in plain Python and the SM count once per device.
"""
from __future__ import annotations

import functools
import os

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, as triton.cdiv."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, as triton.next_power_of_2 (0 for n <= 0, as its bit trick gives)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(dev: torch.device) -> int:
    """The device's SM count (1 off CUDA), read once per device."""
    return _sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 1


# ---- the launch itself ------------------------------------------------------------------------------------------
# `kernel[grid](*args)` on a compiled Triton 3.6 kernel runs Python that does not depend on the call before the
# driver call: knob lookups, the current device and stream through Triton's driver object, the argument binder, a
# cache key built with str() of the options, a check of the kernel's globals, launch metadata and two calls of the
# (empty) launch-hook chains. Under cProfile on the H200 machine's host (2026-12-02, docs/benchmarks.md, issue 17
# in the fifteenth session) a launch of the grouped linear's kernels took 101 us, of which the compiled kernel's own
# launcher 24 us. `launcher(kernel)[grid](*args)` keeps the first
# launch of every specialisation on that path and afterwards calls the compiled kernel's launcher directly, after
# Triton's own binder: the specialisation (argument types, 16-byte alignments, integers equal to 1 or divisible by
# 16, constexpr values) and the options come from the binder, so the compiled kernel is the one Triton would pick.
# Only for Triton 3.6 (the version the kernels were measured and tested with on the H200: the binder, the device
# caches and CompiledKernel.run are its internals); elsewhere, under the interpreter, with a launch hook installed
# (a profiler's), or with MINITE_FAST_LAUNCH=0, it is `kernel[grid]` itself.

def _fast_launch_supported() -> bool:
    import triton
    return triton.__version__.split(".")[:2] == ["3", "6"] and os.environ.get("MINITE_FAST_LAUNCH", "1") != "0"


class Launcher:
    """`launcher(kernel)[grid](*args, **kwargs)`: the same launch as `kernel[grid](*args, **kwargs)`, with Triton's
    per-launch Python skipped after a specialisation's first launch (see above)."""

    def __init__(self, kernel):
        from triton.runtime.jit import JITFunction
        self.kernel = kernel
        self.fast = isinstance(kernel, JITFunction) and _fast_launch_supported()
        self.compiled: dict = {}

    def __getitem__(self, grid):
        if not self.fast:
            return self.kernel[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        from triton import knobs
        device = torch._C._cuda_getDevice()
        caches = self.kernel.device_caches.get(device)
        if caches is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            # the first launch on this device, or a profiler's launch hooks
            return self.kernel[grid](*args, **kwargs)
        params, specialization, options = caches[4](*args, **kwargs)  # Triton's binder
        key = (tuple(specialization), tuple(options.items()))
        try:
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable constexpr value: Triton's own path
            return self.kernel[grid](*args, **kwargs)
        if compiled is None:
            compiled = self.compiled[key] = self.kernel[grid](*args, **kwargs)  # compiles if need be, and launches
            return compiled
        g = tuple(grid(params) if callable(grid) else grid) + (1, 1)
        compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *params.values())
        return compiled


def _hooked(hook) -> bool:
    """Whether a Triton launch hook would do anything: Triton 3.6 keeps an (empty) HookChain there by default, which
    its own launch calls twice per launch, with launch metadata built for it."""
    return hook is not None and bool(getattr(hook, "calls", True))


_LAUNCHERS: dict = {}


def launcher(kernel) -> Launcher:
    """The `Launcher` of a @triton.jit kernel (one per kernel)."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found
