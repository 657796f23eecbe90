"""NVFP4 for groups of tensors that are quantised separately but stored and multiplied together (MoE experts).

Two layouts, each with the reference (a loop over `quantize` / `gemm_reference`, the specification) and a Triton
path that does all members in one amax launch and one quantisation launch, bitwise equal to the loop:

- `NVFP4Stack`: E tensors of one shape [R, C], e.g. the expert weights [E, N, K], each quantised as its own tensor
  (one global scale per expert). `quantize_stack(w)` quantises them; `stack[e]` is expert e's NVFP4Tensor (a view);
  `stack.t()` is every member's exact 16x16 transpose (dgrad's operand). `grouped_gemm` accepts a stack.
- `NVFP4Segments`: column segments of one [R, T] tensor, segment e of width w_e quantised as its own tensor
  [R, w_e] (its own global scale, stochastic-rounding seed and element index). This is the MoE wgrad operand: dy^T
  and x^T with the permuted tokens grouped by expert, each expert's tokens zero-padded to a multiple of 16, so that
  dW_e = Q(dy_e^T) @ Q(x_e^T)^T quantises exactly as a separate linear layer's wgrad would. `segmented_gemm(a, b)`
  computes all E products.

Segments and stacks carry optional fp16 block values (`values`), which the kernels read instead of decoding nibbles.
A stack that carries them can drop its packed codes (`drop_codes`, the learner's weights during a train step): the
kernels' GEMMs then read the values alone, and nothing can take a member out of it any more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .backend import has_kernel, kernel, resolve
from .gemm import gemm_reference
from .quantize import _validate, quantize_reference
from .tensor import BLOCK_1D, BLOCK_2D, NVFP4Tensor, e2m1_table, pack_codes, unpack_codes

VALUES_DTYPE = torch.float16


DECODE_BLOCK = 64
"""Bytes (128 codes along K) per block of the decode order.

The decode order is the layout the small-M W4A4 kernel reads packed weights in (kernels/nvfp4_gemm.py, DECODE_ORDER):
32-bit words of 8 codes each, laid out so that one thread loads its codes as vectors and turns a word into the fp16
bits of four MMA registers with 11 integer operations (the plain nibble order took 22, plus the repacking of 16-bit
halves). On Hopper the MMA fragment gives thread t (0..3) of a quad the code pairs 2t, 2t+1 and 2t+8, 2t+9 of each
16-code group, two codes to a 32-bit register. Of a row's 128-code block, word 4t + q (t, q 0..3; 16 words) holds
the register pairs i = 0..3 of codes 32q + 16(i // 2) + 8(i % 2) + 2t + h, h 0..1: half h of the word (bits 16h..)
holds code h of every pair, pair i's three magnitude bits at 16h + WORD_MAG_BIT[i] and its sign at
16h + WORD_SIGN_BIT[i]. Shifting the word left by 9 - WORD_MAG_BIT[i] (15 - WORD_SIGN_BIT[i]) puts pair i's
magnitudes (signs) at bits 9..11 and 25..27 (15 and 31), where the fp16 bits of code x 2^-14 have them."""
WORD_MAG_BIT = (9, 6, 3, 0)
WORD_SIGN_BIT = (15, 12, 14, 13)


DECODE_CHUNK_BYTES = 16 << 20
"""Packed bytes `decode_order` rearranges at a time: its temporaries are a few times a chunk, not of the whole stack
(128 experts' FC1 of Qwen3-30B-A3B is 201 MB packed)."""


def decode_order(data: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., C/2] (C a multiple of 128) in the decode order (`DECODE_BLOCK`); a copy, uint8 of the same
    shape (the words' bytes, little-endian). Only the layout changes: the codes, scales and results do not. On a
    CUDA tensor with the kernels loaded: one launch (minite.kernels.nvfp4_decode_order, the same bytes); here the
    torch ops, chunked."""
    *lead, nb = data.shape
    if nb % DECODE_BLOCK:
        raise ValueError(f"decode_order: K = {2 * nb} is not a multiple of {2 * DECODE_BLOCK}")
    if data.is_cuda and has_kernel("decode_order"):
        return kernel("decode_order")(data)
    rows = data.reshape(-1, nb)
    out = torch.empty(rows.shape[0], nb // 4, dtype=torch.int32, device=data.device)
    step = max(1, DECODE_CHUNK_BYTES // max(1, nb))
    for r0 in range(0, rows.shape[0], step):
        out[r0:r0 + step] = _words(rows[r0:r0 + step])
    return out.view(torch.uint8).reshape(data.shape)  # int32 words as their little-endian bytes


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales [...] decoded for the small-M kernel (kernels/nvfp4_gemm.py, F16_SCALES): fp16 scale x 2^7,
    exact (E4M3 magnitudes 2^-9..448 become 2^-2..57344), computed from the bits as that kernel decodes them in its K
    loop otherwise ((bits & 0x7F) << 7 read as fp16, times 2^15: the sign bit ignored, the NaN byte 0x7F read as 480),
    so a launch reading these computes the same bits as one decoding the bytes. 2 B per 16x16 block of a weight (1/128
    B per element): the kernel's loop saves ~4 integer operations per scale."""
    bits = ((scale.view(torch.uint8).to(torch.int32) & 0x7F) << 7).to(torch.int16)
    return (bits.view(torch.float16).float() * 32768.0).to(torch.float16)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """int32 words [R, C/8] of packed rows [R, C/2] (`decode_order`): each pair's codes ORed in place."""
    n, nb = rows.shape
    # code 32q + 16a + 8b + 2t + h of a block as [q, a, b, t, h] -> [t, q, a, b, h]: word 4t + q, pair i = 2a + b
    c = unpack_codes(rows).view(n, nb // DECODE_BLOCK, 4, 2, 2, 4, 2).permute(0, 1, 5, 2, 3, 4, 6)
    words = torch.zeros(n, nb // DECODE_BLOCK, 4, 4, dtype=torch.int32, device=rows.device)
    for i, h in ((i, h) for i in range(4) for h in range(2)):
        code = c[..., i // 2, i % 2, h].to(torch.int32)
        words |= ((code & 7) << (WORD_MAG_BIT[i] + 16 * h)) | ((code >> 3) << (WORD_SIGN_BIT[i] + 16 * h))
    return words.view(n, nb // 4)


@dataclass
class NVFP4Stack:
    """E NVFP4 tensors of one shape, stored stacked: data uint8 [E, R, C/2], scale e4m3 [E, R/br, C/16],
    global_scale fp32 [E] (one per member) or [E, R] (per row, (1, 16) blocks: e.g. a ModelOpt gate/up weight whose
    two halves carry different scales), values fp16 [E, R, C] block values or None, amax fp32 of global_scale's
    shape (each member's decode amax, NVFP4Tensor.amax), decode_data uint8 [E, R, C/2] the codes again in the decode
    kernel's order (`decode_order`) or None (small-M GEMMs on packed weights read it; the layout has no other use),
    decode_scale fp16 [E, R/br, C/16] the scales decoded for that kernel (`decode_scales`) or None.
    data is None in a values-only stack (`drop_codes`)."""

    data: Optional[torch.Tensor]
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]
    block: tuple[int, int]
    values: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    decode_data: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    decode_scale: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _transposed: Optional["NVFP4Stack"] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        e = self.scale.shape[0]
        rows, cols = self.shape
        br = self.block[0]
        if self.data is None and self.values is None:
            raise ValueError("NVFP4Stack: needs its packed codes (data) or its block values (values)")
        want = {"scale": (self.scale, torch.float8_e4m3fn, (e, rows // br, cols // 16)),
                "global_scale": (self.global_scale, torch.float32, (e,) if self.global_scale.dim() < 2 else (e, rows))}
        if self.global_scale.dim() == 2 and br != 1:
            raise ValueError("NVFP4Stack: per-row global scales need (1, 16) blocks")
        if self.data is not None:
            want["data"] = (self.data, torch.uint8, (e, rows, cols // 2))
        if self.values is not None:
            want["values"] = (self.values, VALUES_DTYPE, (e, rows, cols))
        if self.amax is not None:
            want["amax"] = (self.amax, torch.float32, tuple(self.global_scale.shape))
        if self.decode_data is not None:
            want["decode_data"] = (self.decode_data, torch.uint8, (e, rows, cols // 2))
        if self.decode_scale is not None:
            want["decode_scale"] = (self.decode_scale, torch.float16, (e, rows // br, cols // 16))
        for name, (t, dtype, shape) in want.items():
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"NVFP4Stack.{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")

    def __len__(self) -> int:
        return self.scale.shape[0]

    def keep_decode_order(self) -> "NVFP4Stack":
        """Keep the codes again in the decode order and the scales decoded (`decode_order`, `decode_scales`), the
        pair the small-M kernel reads together. Returns self."""
        self.decode_data, self.decode_scale = decode_order(self._codes("keep_decode_order")), decode_scales(self.scale)
        return self

    def drop_codes(self) -> "NVFP4Stack":
        """Free the packed codes (and their decode-order copy) of a stack that keeps its block values: 0.5 B per
        element for GEMMs that read only the values (the kernels'). Returns self."""
        if self.values is None:
            raise ValueError("NVFP4Stack.drop_codes: the stack has no block values, the codes are all it holds")
        self.data = self.decode_data = self.decode_scale = self._transposed = None
        return self

    def _codes(self, what: str) -> torch.Tensor:
        if self.data is None:
            raise ValueError(f"NVFP4Stack.{what}: this stack keeps block values only (drop_codes freed its codes)")
        return self.data

    def __getitem__(self, e: int) -> NVFP4Tensor:
        self._codes("__getitem__")
        return NVFP4Tensor(self.data[e], self.scale[e], self.global_scale[e], self.shape, self.block,
                           None if self.values is None else self.values[e],
                           None if self.amax is None else self.amax[e])

    def __iter__(self):
        return (self[e] for e in range(len(self)))

    @classmethod
    def from_tensors(cls, tensors: Sequence[NVFP4Tensor]) -> "NVFP4Stack":
        """Stack NVFP4 tensors of one shape and block (copies). If any member has per-row global scales, every
        member's scale is stored per row (a per-tensor scale repeated: the same products)."""
        first = tensors[0]
        for e, t in enumerate(tensors):
            if t.shape != first.shape or t.block != first.block:
                raise ValueError(f"member {e}: shape {t.shape} block {t.block}; all members need shape "
                                 f"{first.shape} and block {first.block}")
        per_row = any(t.per_row for t in tensors)

        def stacked(vals):
            if per_row:
                return torch.stack([v if v.dim() else v.expand(first.shape[0]) for v in vals])
            return torch.stack([v.reshape(()) for v in vals])

        amax = None if any(t.amax is None for t in tensors) else stacked([t.amax for t in tensors])
        return cls(torch.stack([t.data for t in tensors]), torch.stack([t.scale for t in tensors]),
                   stacked([t.global_scale for t in tensors]), first.shape, first.block, amax=amax)

    def t(self) -> "NVFP4Stack":
        """Every member transposed exactly (16x16 blocks; see NVFP4Tensor.t), computed once per stack."""
        if self.block != BLOCK_2D or self.global_scale.dim() != 1:
            raise ValueError(f"t() needs (16, 16) blocks and one global scale per member, got {self.block}")
        if self._transposed is None:
            e, (rows, cols) = len(self), self.shape
            codes = unpack_codes(self._codes("t()").reshape(e * rows, cols // 2)).reshape(e, rows, cols)
            data = pack_codes(codes.transpose(1, 2).reshape(e * cols, rows)).reshape(e, cols, rows // 2)
            vals = None if self.values is None else self.values.transpose(1, 2).contiguous()
            self._transposed = NVFP4Stack(data, self.scale.transpose(1, 2).contiguous(), self.global_scale,
                                          (cols, rows), self.block, vals, self.amax)
        return self._transposed


@dataclass
class NVFP4Segments:
    """Column segments of one [R, T] tensor, each quantised along T as its own tensor (1x16 blocks):
    data uint8 [R, T/2], scale e4m3 [R, T/16], global_scale fp32 [E], widths (multiples of 16, summing to T),
    values fp16 [R, T] or None, amax fp32 [E] (each segment's decode amax; 0 for an empty one).
    widths is a host tuple, or an integer tensor on the device (`quantize_count_segments` from device counts): then
    T is an upper bound of their sum, and the columns past it are unused."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    widths: tuple[int, ...] | torch.Tensor
    values: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None

    @property
    def host_widths(self) -> tuple[int, ...]:
        """The widths as host integers (a host synchronisation for device widths on a GPU)."""
        return tuple(int(w) for w in self.widths.tolist()) if torch.is_tensor(self.widths) else tuple(self.widths)

    @property
    def starts(self) -> list[int]:
        return _starts(self.host_widths)

    def with_values(self, backend: str = "auto") -> "NVFP4Segments":
        """Keep fp16 block values, computed from the codes when missing: bitwise the values the quantiser writes
        with values=True (one launch on the kernels, minite.kernels.nvfp4_values). A segment operand kept packed
        (0.5625 B per element) until the GEMM that reads values (the MoE wgrad's x^T). Returns self."""
        if self.values is None:
            if _use_triton(backend, self.data) and has_kernel("block_values"):
                self.values = kernel("block_values")(self.data, self.scale)
            else:
                scale = self.scale.float().repeat_interleave(16, dim=1)
                self.values = (e2m1_table(self.data.device)[unpack_codes(self.data).long()] * scale).to(VALUES_DTYPE)
        return self

    def segment(self, e: int) -> NVFP4Tensor:
        """Segment e as a standalone NVFP4Tensor [R, w_e] (copies)."""
        s, w = self.starts[e], self.host_widths[e]
        rows = self.data.shape[0]
        return NVFP4Tensor(self.data[:, s // 2:(s + w) // 2].contiguous(),
                           self.scale[:, s // 16:(s + w) // 16].contiguous(), self.global_scale[e], (rows, w),
                           BLOCK_1D, amax=None if self.amax is None else self.amax[e])


def padded(rows):
    """rows rounded up to a multiple of 16 (the wgrad quantises along the tokens in 16-blocks, one expert's tokens
    zero-padded to whole blocks); an int, or elementwise for an integer numpy array or torch tensor."""
    return (rows + 15) & -16  # two ops on a tensor (add, and), the same integers as rows + (-rows) % 16


def segmented_gemm_passes(a: list, b: list, accumulate: torch.Tensor, *, backend: str = "auto",
                          zeroed: bool = False) -> torch.Tensor:
    """accumulate[e] += a[p]_e @ b[p]_e^T for each pass p in order (the MoE wgrads of several micro-batches, each
    pair of segment operands as `segmented_gemm` takes them): bitwise `segmented_gemm(a[p], b[p],
    accumulate=accumulate)` for p = 0, 1, ... On the kernels one launch reads and writes accumulate once (the passes'
    products are added in registers, in pass order); the reference runs the passes one by one. zeroed: as in
    `segmented_gemm`."""
    if not a or len(a) != len(b):
        raise ValueError(f"segmented_gemm_passes: as many passes of a as of b, at least one ({len(a)} and {len(b)})")
    if resolve(backend, a[0].data, op="gemm")[0] == "triton" and has_kernel("segmented_gemm_passes"):
        for pa, pb in zip(a, b):  # the checks of segmented_gemm, pass by pass (no host synchronisation)
            if torch.is_tensor(pa.widths) != torch.is_tensor(pb.widths) or pa.data.shape[1] != pb.data.shape[1]:
                raise ValueError("segmented_gemm_passes: each pass needs both operands' segments of the same counts")
        return kernel("segmented_gemm_passes")(a, b, accumulate, zeroed=zeroed)
    for i, (pa, pb) in enumerate(zip(a, b)):
        segmented_gemm(pa, pb, backend=backend, accumulate=accumulate, zeroed=zeroed and i == 0)
    return accumulate


def check_accumulate(buf: torch.Tensor, shape: tuple, device, what: str) -> None:
    """The gradient buffer a wgrad adds into in place (`segmented_gemm(accumulate=)`): contiguous fp32 of `shape`
    on `device`, or a one-line error."""
    if (buf.dtype != torch.float32 or tuple(buf.shape) != tuple(shape) or not buf.is_contiguous()
            or buf.device != torch.device(device)):
        raise ValueError(f"{what}: accumulate must be a contiguous fp32 {list(shape)} tensor on {device}, got "
                         f"{buf.dtype} {tuple(buf.shape)}{'' if buf.is_contiguous() else ' (strided)'} on {buf.device}")


def _starts(widths: Sequence[int]) -> list[int]:
    """First column of each segment."""
    out, s = [], 0
    for w in widths:
        out.append(s)
        s += w
    return out


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    return resolve(backend, x, op="quantize")[0] == "triton"


def _check_rounding(rounding: str, seeds, n: int) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and (seeds is None or len(seeds) != n):
        raise ValueError(f"stochastic rounding needs {n} seeds (one per member), got {seeds!r}")
    if seeds is not None and len(seeds):
        lo, hi = (int(seeds.min()), int(seeds.max())) if hasattr(seeds, "min") else (min(seeds), max(seeds))
        if lo < 0 or hi >= 2**32:
            raise ValueError(f"seed must be in [0, 2^32), got {lo if lo < 0 else hi}")


def stack_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x[e]| per member of x [E, R, C], fp32 [E]: one `aminmax` reduction over x, then max(-min, max) (exact,
    the same value as any order of max |x|; abs turns a -0 into the +0 the kernel's max would give). On the H200 the
    segments amax kernel read the expert stacks at ~0.7 TB/s (profile in docs/benchmarks.md); a torch reduction reads
    them near HBM speed."""
    if x.numel() == 0:  # aminmax refuses an empty reduction
        return torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.reshape(x.shape[0], -1), dim=1)
    return torch.maximum(-lo, hi).abs().float()


def _given_amax(x: torch.Tensor, amax: Optional[torch.Tensor]) -> torch.Tensor:
    """The caller's amax of `quantize_stack` (shape, dtype and device checked), or stack_amax(x) without one."""
    if amax is None:
        return stack_amax(x)
    if amax.dtype != torch.float32 or tuple(amax.shape) != (x.shape[0],) or amax.device != x.device:
        raise ValueError(f"quantize_stack: amax must be fp32 [{x.shape[0]}] on {x.device}, got {amax.dtype} "
                         f"{tuple(amax.shape)} on {amax.device}")
    return amax


def quantize_stack(x: torch.Tensor, *, block=BLOCK_2D, rounding: str = "nearest", seeds=None, rht: bool = False,
                   values: bool = False, check_finite: bool = True, backend: str = "auto",
                   amax: Optional[torch.Tensor] = None) -> NVFP4Stack:
    """Quantise each x[e] of x [E, R, C] as its own tensor (scale_scope="tensor"); `values` also keeps the fp16
    block values. check_finite=False skips the NaN/Inf check (a host synchronisation on a GPU).
    amax: each member's max |x[e]|, fp32 [E] on x's device, computed where x was last written (the optimizer's
    master -> weight copy, minite.kernels.copy_amax): the kernels then skip their own read of x for it
    (`stack_amax`). It must be bitwise stack_amax(x), which the caller guarantees (nothing checks it: that would be
    the read it saves). Ignored by the reference (which computes the same amax itself) and with the RHT (whose amax
    is of the transformed values)."""
    if x.dim() != 3:
        raise ValueError(f"quantize_stack expects [E, R, C], got shape {tuple(x.shape)}")
    block = tuple(block)
    e, rows, cols = x.shape
    flat = x.reshape(e * rows, cols)
    if check_finite:
        _validate(flat, block, "tensor", rounding)
    _check_rounding(rounding, seeds, e)
    if _use_triton(backend, x):
        segs = [(i * rows, 0, rows, cols, i * rows, 0) for i in range(e)]
        data, scale, gs, amax, vals = kernel("quantize_segments")(flat, segs, (e * rows, cols), block, rounding, seeds,
                                                               rht, VALUES_DTYPE if values else None,
                                                               amax=None if rht else _given_amax(x, amax))
        br = block[0]
        return NVFP4Stack(data.view(e, rows, cols // 2), scale.view(e, rows // br, cols // 16), gs, (rows, cols),
                          block, None if vals is None else vals.view(e, rows, cols), amax)
    qs = [quantize_reference(x[i], block=block, scale_scope="tensor", rounding=rounding,
                             seed=None if seeds is None else int(seeds[i]), rht=rht) for i in range(e)]
    st = NVFP4Stack.from_tensors(qs)
    if values:
        st.values = torch.stack([q.block_values(VALUES_DTYPE) for q in qs])
    return st


def quantize_column_segments(x: torch.Tensor, widths: Sequence[int], *, rounding: str = "nearest", seeds=None,
                             rht: bool = False, values: bool = False, check_finite: bool = True,
                             backend: str = "auto", counts: Sequence[int] | None = None) -> NVFP4Segments:
    """Quantise column segments of x [R, T] (T = sum of widths, each a multiple of 16, or sum of counts; x may be a
    strided view such as the transpose of the permuted tokens) along T, segment e as its own [R, w_e] tensor: one
    global scale (1 for an empty segment), stochastic rounding from seeds[e] indexed inside the segment, RHT per 16
    columns.
    counts: x holds sum(counts) columns, and segment e is its next counts[e] <= widths[e] columns zero-padded to
    widths[e] (the MoE wgrad's experts; the kernels pad inside, without a padded copy of x). widths and counts are
    host sequences of integers (a list, tuple or numpy array)."""
    w = np.asarray(widths, dtype=np.int64).reshape(-1)  # array operations: the MoE wgrad has one segment per expert
    c = w if counts is None else np.asarray(counts, dtype=np.int64).reshape(-1)
    if (x.dim() != 2 or len(c) != len(w) or int(c.sum()) != x.shape[1]
            or ((w % 16 != 0) | (c < 0) | (c > w)).any()):
        raise ValueError(f"quantize_column_segments: widths {w.tolist()} must be multiples of 16, each at least its "
                         f"count {c.tolist()}, the counts summing to the columns of x {tuple(x.shape)}")
    widths, counts = tuple(w.tolist()), tuple(c.tolist())
    if check_finite:  # the shapes are checked above (x's columns need not be a multiple of 16 with counts)
        _validate(x, BLOCK_1D, "tensor", rounding, check_shape=False)
    _check_rounding(rounding, seeds, len(widths))
    rows, total = x.shape[0], sum(widths)
    if _use_triton(backend, x):  # the table (x_row, x_col, rows, cols, out_row, out_col, read) per segment
        zero = np.zeros_like(w)
        segs = np.stack([zero, np.cumsum(c) - c, np.full_like(w, rows), w, zero, np.cumsum(w) - w, c], axis=1)
        data, scale, gs, amax, vals = kernel("quantize_segments")(x, segs, (rows, total), BLOCK_1D, rounding, seeds,
                                                               rht, VALUES_DTYPE if values else None)
        return NVFP4Segments(data, scale, gs, widths, vals, amax)
    starts = _starts(widths)
    if counts != widths:  # the reference on the padded copy
        padded = x.new_zeros(rows, total)
        for c0, s, c in zip(_starts(counts), starts, counts):
            padded[:, s:s + c] = x[:, c0:c0 + c]
        x = padded
    datas, scales, gss, amaxes, vals = [], [], [], [], []
    for e, (s, w) in enumerate(zip(starts, widths)):
        if w == 0:
            gss.append(torch.ones((), dtype=torch.float32, device=x.device))
            amaxes.append(torch.zeros((), dtype=torch.float32, device=x.device))
            continue
        q = quantize_reference(x[:, s:s + w], block=BLOCK_1D, scale_scope="tensor", rounding=rounding,
                               seed=None if seeds is None else int(seeds[e]), rht=rht)
        datas.append(q.data)
        scales.append(q.scale)
        gss.append(q.global_scale.reshape(()))
        amaxes.append(q.amax.reshape(()))
        if values:
            vals.append(q.block_values(VALUES_DTYPE))
    empty = torch.empty(rows, 0, dtype=torch.uint8, device=x.device)
    data = torch.cat(datas, dim=1) if datas else empty
    scale = torch.cat(scales, dim=1) if scales else empty.view(torch.float8_e4m3fn)
    val = (torch.cat(vals, dim=1) if vals else x.new_zeros(rows, 0, dtype=VALUES_DTYPE)) if values else None
    return NVFP4Segments(data, scale, torch.stack(gss), widths, val, torch.stack(amaxes))


def quantize_count_segments(x: torch.Tensor, counts, *, rounding: str = "nearest", seeds=None, rht: bool = False,
                            values: bool = False, check_finite: bool = True, backend: str = "auto") -> NVFP4Segments:
    """Column segments of x [R, T] by counts: segment e is the next counts[e] columns of x, zero-padded to a multiple
    of 16 (the MoE wgrad's experts): `quantize_column_segments` with the padded counts as widths, the same bits.
    counts: host integers, or an integer tensor. On the kernels a tensor on x's device stays there (no host
    synchronisation, minite.kernels.nvfp4_segments.quantize_count_segments_triton; a host tensor, e.g. the counts
    Megatron's alltoall dispatcher hands over under EP, is read as host integers): the result's widths are then
    the padded counts as a device tensor, its data an upper bound of columns wide, and the counts are trusted to sum
    to T (checking would read them)."""
    if (torch.is_tensor(counts) and counts.device == x.device and _use_triton(backend, x)
            and has_kernel("quantize_count_segments")):
        if counts.dim() != 1:
            raise ValueError(f"quantize_count_segments: counts of shape {tuple(counts.shape)}, expected [E]")
        if check_finite:
            _validate(x, BLOCK_1D, "tensor", rounding, check_shape=False)
        _check_rounding(rounding, seeds, counts.numel())
        data, scale, gs, amax, vals = kernel("quantize_count_segments")(x, counts, rounding, seeds, rht,
                                                                     VALUES_DTYPE if values else None)
        return NVFP4Segments(data, scale, gs, padded(counts.to(device=x.device, dtype=torch.int32)), vals, amax)
    c = np.asarray(counts.tolist() if torch.is_tensor(counts) else counts, dtype=np.int64).reshape(-1)
    return quantize_column_segments(x, padded(c), rounding=rounding, seeds=seeds, rht=rht, values=values,
                                    check_finite=check_finite, backend=backend, counts=c)


def segmented_gemm(a: NVFP4Segments, b: NVFP4Segments, *, out_dtype: torch.dtype = torch.float32,
                   backend: str = "auto", accumulate: Optional[torch.Tensor] = None,
                   zeroed: bool = False) -> torch.Tensor:
    """out[e] = a_e @ b_e^T for matching segments (the MoE wgrad: [E, Ra, Rb]); an empty segment gives zeros.
    Device widths (count segments of the same counts) are trusted to match: comparing them would synchronise.
    accumulate: a contiguous fp32 [E, Ra, Rb] tensor that the fp32 products are added to in place and that is
    returned (a gradient accumulated as Megatron's main_grad; out_dtype unused): bitwise accumulate + the fp32
    result, without writing the result first. zeroed: the caller's promise that accumulate holds +0.0 everywhere (a
    gradient buffer zeroed and not added to since): the kernels write it without reading it, the same bits as the
    add (+0.0 + x is x, with a -0.0 product made +0.0 as the add makes it); the reference adds as always."""
    on_device = torch.is_tensor(a.widths), torch.is_tensor(b.widths)
    if any(on_device):
        if not all(on_device) or a.widths.shape != b.widths.shape or a.data.shape[1] != b.data.shape[1]:
            raise ValueError("segmented_gemm: both operands need the segments of the same counts (device widths "
                             f"{tuple(a.widths.shape) if on_device[0] else a.widths} vs "
                             f"{tuple(b.widths.shape) if on_device[1] else b.widths})")
    elif a.widths != b.widths:
        raise ValueError(f"segmented_gemm: segment widths differ ({a.widths} vs {b.widths})")
    ra, rb = a.data.shape[0], b.data.shape[0]
    if accumulate is not None:
        check_accumulate(accumulate, (len(a.widths), ra, rb), a.data.device, "segmented_gemm")
    if resolve(backend, a.data, op="gemm")[0] == "triton":
        return kernel("segmented_gemm")(a, b, out_dtype, accumulate=accumulate, zeroed=zeroed)
    out = torch.zeros(len(a.widths), ra, rb, dtype=torch.float32 if accumulate is not None else out_dtype,
                      device=a.data.device)
    for e, w in enumerate(a.host_widths):
        if w:
            out[e] = gemm_reference(a.segment(e), b.segment(e), out.dtype)
    return out if accumulate is None else accumulate.add_(out)
