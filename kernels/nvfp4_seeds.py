"""Host-side seed mixing for the stochastic-rounding quantisation kernels (kernels/nvfp4_quant.py).

A kernel draws the 24 random bits of element i as lowbias32((i + mix) mod 2^32) >> 8, mix = seed_mix(seed): the
uint32 counter hash of minite.nvfp4.quantize.uniform_u24 (the reference), so a seed gives the same bits everywhere.
The mix is computed on the host once per tensor (`seed_mixes`: a whole segment table at once), passed as an int32;
a segment launch reads its mixes from the device (`device_seed_mixes`: uploaded once per seed array and kept).
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from minite.nvfp4.device_copy import host_to


def seed_mix(seed: int) -> int:
    """lowbias32(seed ^ 0x9E3779B9), the per-seed offset of minite.nvfp4.quantize.uniform_u24 (host side)."""
    x = (int(seed) ^ 0x9E3779B9) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def seed_mixes(seeds) -> np.ndarray:
    """`seed_mix` of each seed, as the int32 with the same bits (one array operation for a segment table's seeds)."""
    seeds = seeds.tolist() if torch.is_tensor(seeds) else seeds
    x = (np.asarray(seeds, dtype=np.int64).reshape(-1) & 0xFFFFFFFF).astype(np.uint32) ^ np.uint32(0x9E3779B9)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)  # uint32 arrays wrap mod 2^32
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x.view(np.int32)


def _as_int32_bits(u: int) -> int:
    """A uint32 as the int32 with the same bits (one argument type for every seed)."""
    return u - (1 << 32) if u >= (1 << 31) else u


_DEVICE_MIXES: collections.OrderedDict = collections.OrderedDict()
_DEVICE_MIXES_KEPT = 4096  # x 128 experts x 4 B: 2 MiB of device memory at most


def device_seed_mixes(seeds, dev: torch.device) -> torch.Tensor:
    """`seed_mixes(seeds)` as an int32 tensor on `dev`, read only: uploaded once per seed array and device and kept
    (the least recently used dropped past `_DEVICE_MIXES_KEPT`). The MoE wgrad quantises each layer's operands with
    the same per-expert seeds in every micro-batch of a step, and an upload (pinned staging and a copy) costs ~24 us
    of host time on the H200 against a lookup's ~2 us."""
    arr = np.ascontiguousarray(np.asarray(seeds, dtype=np.int64).reshape(-1))
    key = (arr.tobytes(), dev.type, dev.index)
    mixes = _DEVICE_MIXES.get(key)
    if mixes is None or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        mixes = host_to(torch.from_numpy(seed_mixes(arr).copy()), dev)  # under capture host_to refuses, as before
        _DEVICE_MIXES[key] = mixes
        if len(_DEVICE_MIXES) > _DEVICE_MIXES_KEPT:
            _DEVICE_MIXES.popitem(last=False)
    else:
        _DEVICE_MIXES.move_to_end(key)
    return mixes
