"""Host-side seed mixing for the stochastic-rounding quantisation kernels (kernels/nvfp4_quant.py).

A kernel draws the 24 random bits of element i as lowbias32((i + mix) mod 2^32) >> 8, mix = seed_mix(seed): the
uint32 counter hash of minite.nvfp4.quantize.uniform_u24 (the reference), so a seed gives the same bits everywhere.
The mix is computed on the host once per tensor (`seed_mixes`: a whole segment table at once), passed as an int32.
"""
from __future__ import annotations

import numpy as np
import torch


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
