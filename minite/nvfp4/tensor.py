"""NVFP4Tensor: packed E2M1 codes, E4M3 block scales and an FP32 global decode scale.

Bit layout (the same one Transformer Engine and ModelOpt checkpoints use):
- `data` uint8 [R, C/2]: two 4-bit codes per byte, the even-indexed element in the low nibble (None in a tensor that
  keeps only its block values, `drop_codes`).
  A code is sign bit (8) | magnitude index 0..7 for 0, 0.5, 1, 1.5, 2, 3, 4, 6. Code 8 is "-0".
- `scale` float8_e4m3fn [R/br, C/16]: one block scale per (br x 16) block, row-major block order.
- `global_scale` float32: the decode scale S_dec = 1/S_enc, a 0-d tensor (one per tensor) or [R] (one per row); the
  quantiser's element multipliers use it.
- `amax` float32, the shape of `global_scale`: the amax the global scale was computed from (the "decode amax"; where
  S_enc saturated at FLT_MAX, fl(2688 / FLT_MAX) instead, docs/nvfp4.md). Transformer Engine's GEMM and
  dequantisation use the amax, not S_dec: GEMM alpha = (amax_a * amax_b) * fl(1/(6*6*448*448)), dequantised value =
  (e2m1 * block scale) * fl(amax / 2688); so the tensor carries it.
- `values` (optional, derived): fp16 [R, C] block values, code x block scale, kept for GEMM kernels that read
  them instead of decoding nibbles (`quantize(..., values=True)`); not part of the format, ignored by `equal`.

Value of element (i, j) = (e2m1(code) x float(scale[i // br, j // 16])) x fl(amax[(i)] / 2688) in fp32: TE's NVFP4
test formula and ModelOpt's (its weight_scale_2 is fl(amax / 2688)), so a ModelOpt loader decodes our export to these
bits. TE's CUDA dequantisation kernel multiplies in another order, (scale x amax) x fl(1/2688), which overflows for
amax near FLT_MAX (docs/nvfp4.md, "Dequantisation").
The product e2m1 x e4m3 has at most 6 significant bits (magnitudes 2^-10 .. 2688), so the block-dequantised
value without the global scale is exact in bf16, fp16 and fp32: `block_values()` is lossless, and an MMA on those
values with fp32 accumulation computes the NVFP4 product exactly up to summation order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 8
BLOCK_1D = (1, 16)
BLOCK_2D = (16, 16)
# fp32 constants of TE's arithmetic, each the fp32 rounding of the exact rational (docs/nvfp4.md)
FACTOR_INV = float(np.float32(1.0 / (6.0 * 6.0 * 448.0 * 448.0)))  # GEMM: alpha = (amax_a * amax_b) * FACTOR_INV


def e2m1_table(device=None) -> torch.Tensor:
    """fp32 value of each of the 16 codes (index = code)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] uint8 codes (0..15) -> [R, C/2] uint8, even element in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """[R, C/2] uint8 -> [R, C] uint8 codes."""
    low, high = data & 0x0F, data >> 4
    return torch.stack([low, high], dim=-1).reshape(data.shape[0], data.shape[1] * 2)


@dataclass
class NVFP4Tensor:
    """A 2-D tensor quantised along its last dimension (the GEMM's K) in NVFP4."""

    data: Optional[torch.Tensor]
    """None only with `values`: a tensor whose codes were freed (`drop_codes`)."""
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]
    block: tuple[int, int]
    values: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    amax: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _transposed: Optional["NVFP4Tensor"] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        rows, cols = self.shape
        br, bc = self.block
        if self.data is None and self.values is None:
            raise ValueError("NVFP4Tensor needs its packed codes (data) or its block values")
        expect = {
            "data": (self.data, torch.uint8, (rows, cols // 2)),
            "scale": (self.scale, torch.float8_e4m3fn, (rows // br, cols // bc)),
        }
        for name, (t, dtype, shape) in expect.items():
            if t is None:
                continue
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"NVFP4Tensor.{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        gs = self.global_scale
        if gs.dtype != torch.float32 or tuple(gs.shape) not in ((), (rows,)):
            raise ValueError(f"NVFP4Tensor.global_scale: expected float32 of shape () or ({rows},), "
                             f"got {gs.dtype} {tuple(gs.shape)}")
        if gs.dim() == 1 and br != 1:
            raise ValueError("per-row global scales need (1, 16) blocks")
        am = self.amax
        if am is not None and (am.dtype != torch.float32 or am.shape != gs.shape):
            raise ValueError(f"NVFP4Tensor.amax: expected float32 of shape {tuple(gs.shape)} (the global scale's), "
                             f"got {am.dtype} {tuple(am.shape)}")
        v = self.values
        if v is not None and (v.dtype != torch.float16 or tuple(v.shape) != (rows, cols)):
            raise ValueError(f"NVFP4Tensor.values: expected float16 {(rows, cols)}, got {v.dtype} {tuple(v.shape)}")

    @property
    def device(self) -> torch.device:
        return self.scale.device

    @property
    def per_row(self) -> bool:
        return self.global_scale.dim() == 1

    def codes(self) -> torch.Tensor:
        """Unpacked codes, uint8 [R, C]."""
        if self.data is None:
            raise ValueError("NVFP4Tensor: this tensor keeps block values only (drop_codes freed its codes)")
        return unpack_codes(self.data)

    def drop_codes(self) -> "NVFP4Tensor":
        """Free the packed codes (and a cached transpose) of a tensor that keeps its block values: 0.5 B per element
        for GEMMs that read only the values (the kernels'; `block_values` returns them). Returns self."""
        if self.values is None:
            raise ValueError("NVFP4Tensor.drop_codes: the tensor has no block values, the codes are all it holds")
        self.data = self._transposed = None
        return self

    def expanded_scale(self) -> torch.Tensor:
        """fp32 block scale broadcast to every element, [R, C]."""
        br, bc = self.block
        s = self.scale.float()
        return s.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)

    def block_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """code x block scale (no global scale): exact in fp32, bf16 and fp16."""
        if self.data is None:  # the kept fp16 block values are these, exactly
            return self.values.to(dtype)
        vals = e2m1_table(self.device)[self.codes().long()] * self.expanded_scale()
        return vals.to(dtype)

    def decode_amax(self) -> torch.Tensor:
        """`amax`, or a one-line error naming the fix when a hand-built tensor lacks it."""
        if self.amax is None:
            raise ValueError("NVFP4Tensor has no amax (the GEMM alpha and dequantize() need it): build it with "
                             "quantize(), or pass amax= (fp32, the global scale's shape)")
        return self.amax

    def decode_scale(self) -> torch.Tensor:
        """fl(amax / 2688) in fp32, the global scale of the dequantisation (ModelOpt's weight_scale_2)."""
        return self.decode_amax() / torch.tensor(2688.0, dtype=torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(e2m1 x block scale) x fl(amax / 2688) in fp32, rounded once to `dtype` (module docstring)."""
        d = self.decode_scale()
        return (self.block_values(torch.float32) * (d[:, None] if self.per_row else d)).to(dtype)

    def t(self) -> "NVFP4Tensor":
        """Transpose of a (16, 16)-block tensor with one global scale: exact, no requantisation.

        A 16x16 block has one scale whichever way it is read, so the codes and the scale grid transpose
        as they are; this is why weights use 2-D blocks (fprop and dgrad share one quantised weight).
        Computed once per tensor (a cached weight is transposed once per update, not once per backward).
        """
        if self.block != BLOCK_2D or self.per_row:
            raise ValueError("t() needs (16, 16) blocks and a per-tensor global scale; "
                             f"got block={self.block}, per_row={self.per_row}")
        if self._transposed is None:
            rows, cols = self.shape
            self._transposed = NVFP4Tensor(
                data=None if self.data is None else pack_codes(self.codes().t().contiguous()),
                scale=self.scale.t().contiguous(),
                global_scale=self.global_scale,
                shape=(cols, rows),
                block=self.block,
                values=None if self.values is None else self.values.t().contiguous(),
                amax=self.amax,
            )
        return self._transposed

    def to(self, device) -> "NVFP4Tensor":
        def moved(t):
            return None if t is None else t.to(device)
        return NVFP4Tensor(moved(self.data), self.scale.to(device), self.global_scale.to(device), self.shape,
                           self.block, moved(self.values), moved(self.amax))

    def equal(self, other: "NVFP4Tensor") -> bool:
        """Bitwise equality of every field but `values` (scales compared as bits, so -0 and NaN patterns count)."""
        if self.data is None or other.data is None:
            raise ValueError("NVFP4Tensor.equal compares packed codes: a tensor keeps block values only (drop_codes)")
        same_amax = (self.amax is None) == (other.amax is None) and (
            self.amax is None or torch.equal(self.amax.view(torch.int32), other.amax.view(torch.int32)))
        return (self.shape == other.shape and self.block == other.block and same_amax
                and torch.equal(self.data, other.data)
                and torch.equal(self.scale.view(torch.uint8), other.scale.view(torch.uint8))
                and torch.equal(self.global_scale.view(torch.int32), other.global_scale.view(torch.int32)))
