"""Host-side helpers of the launchers: grid arithmetic on plain integers, the SM count, small device constants.

An NVFP4 learner step on the H200 waits on its host (docs/benchmarks.md, issue 17), so the launchers' own host
work counts. Measured on the H200 machine's host (2026-12-02): `triton.cdiv` and `triton.next_power_of_2` cost
1.2 us per host call (in Triton 3.6 they are constexpr functions that unwrap their arguments on every call; a
linear's forward and backward call them ~30 times), `torch.cuda.get_device_properties` 4.1 us, `torch.full` of a
one-element tensor 8.3 us, `torch.zeros(())` 9.0 us. The functions here give the same integers in plain Python,
the SM count once per device, and constants made once per device.
"""
from __future__ import annotations

import functools

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


_CONSTANTS: dict = {}


def device_constant(value, dtype: torch.dtype, device: torch.device, shape: tuple = ()) -> torch.Tensor:
    """A tensor of `shape` filled with `value`, made once per (value, dtype, device, shape) and shared: only for
    kernels that read it, never write it. Under CUDA-graph capture a fresh one is made and not kept (the kept one
    would live in the graph's memory pool, which is freed with the graph)."""
    key = (value, dtype, device.type, device.index, shape)
    t = _CONSTANTS.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.full(shape, value, dtype=dtype, device=device)
        with torch.inference_mode(False):  # a normal tensor, also when first made inside a generate
            t = _CONSTANTS[key] = torch.full(shape, value, dtype=dtype, device=device)
    return t
