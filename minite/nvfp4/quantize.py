"""NVFP4 quantisation, the pure-PyTorch reference: Transformer Engine's formula in TE's operation order.

All arithmetic is fp32, in this order (docs/nvfp4.md, "Quantisation"):
    S_enc = min(2688 / amax, FLT_MAX), 1 when amax == 0          (2688 = 448 * 6; amax over the global-scale scope)
    S_dec = 1 / S_enc
    block scale s_b = e4m3_rne(clamp(block_amax * (S_enc * (1/6)), -448, 448))
    multiplier    = min(1 / (float(s_b) * S_dec), FLT_MAX)
    code          = e2m1(clamp(x * multiplier, -6, 6))
S_enc / s_b is *not* the same number as 1 / (s_b * S_dec): keeping TE's order is what makes bitwise agreement with
TE, and between our kernels and this file, possible.
The result also carries the amax (`NVFP4Tensor.amax`; `decode_amax`: SATURATED_AMAX where S_enc saturated), which
TE's GEMM alpha and dequantisation read instead of S_dec. With rht=True, x is first transformed along K
(`apply_rht`, rounded to x's dtype when it is bf16/fp16) and the amax is the transformed values'.

E2M1 rounding: round to nearest, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
saturating at 6; the sign bit is set for x < 0 as in TE's reference: a negative value that rounds to zero gets code 8,
-0.0 gets code 0 (docs/nvfp4.md, "Zero and -0"). Stochastic rounding rounds a magnitude
v between neighbours lo < hi up with probability (v - lo) / (hi - lo); the step hi - lo is a power of two, so the
fraction is an exact fp32 product. Its random numbers come from a counter-based hash of (seed, flat element index) in
uint32 arithmetic (`uniform_u24`), not from torch's RNG, so a GPU kernel can draw exactly the same stream.

Scopes: scale_scope="tensor" gives one global scale; "row" one per row, which makes a token's quantisation independent
of the other tokens in the batch (the batch-invariant choice for activations; docs/nvfp4.md, "Roles").
"""
from __future__ import annotations

import numpy as np
import torch

from .backend import kernel, resolve
from .hadamard import apply_rht
from .tensor import BLOCK_1D, BLOCK_2D, E2M1_MAGNITUDES, NVFP4Tensor, SIGN_BIT, pack_codes


class NonFiniteError(ValueError, FloatingPointError):
    """NaN or Inf where a finite value is needed (NVFP4 has no code for either): a quantiser's input, and, raised
    elsewhere with this class, a model's logits, weights handed to an engine or a step's metrics. In a training run
    it means the run diverged (`minite.rl.failures` reports it so); a ValueError still, for callers that catch those."""


FP32_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Midpoints between neighbouring magnitudes; a tie goes to the even index (0, 1, 2, 4 are even codes: 0, 1, 2, 4).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_INV_STEP = (2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.0)  # 1 / (hi - lo) above each magnitude index; 0 at 6 (saturated)
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (xor-shift / multiply), applied to int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_u24(seed: int, index: torch.Tensor) -> torch.Tensor:
    """24 random bits (int64 in [0, 2^24)) for each flat element index, from a uint32 counter hash.

    h = lowbias32((index + lowbias32(seed ^ 0x9E3779B9)) mod 2^32) >> 8. The index wraps at 2^32 elements.
    """
    mix = _lowbias32(torch.tensor((seed ^ 0x9E3779B9) & _M32, dtype=torch.int64))
    return _lowbias32((index.to(torch.int64) + mix) & _M32) >> 8


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(2688 / amax, FLT_MAX), and 1 where amax is 0 (fp32)."""
    s = torch.clamp(torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32) / amax, max=FP32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


# fl(2688 / FLT_MAX): the amax whose S_enc is FLT_MAX; where S_enc saturates (amax below it) the tensor's decode amax
# is this value, so that (s * amax) * fl(1/2688) decodes with ~1/FLT_MAX, the scale the codes were made with
SATURATED_AMAX = float(np.float32(np.float32(E4M3_MAX * E2M1_MAX) / np.float32(FP32_MAX)))


def decode_amax(amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """The amax a tensor carries for its GEMM alpha and dequantisation: amax itself, or SATURATED_AMAX where
    S_enc = FLT_MAX (docs/nvfp4.md, "Saturated S_enc"); fp32, amax's shape."""
    return torch.where(s_enc == FP32_MAX, torch.full_like(amax, SATURATED_AMAX), amax.float())


def e2m1_round_nearest(mag: torch.Tensor) -> torch.Tensor:
    """Magnitude index 0..7 of |v| <= 6, round to nearest, ties to even.

    Seven vectorised comparisons (measured ~15x faster on CPU than torch.bucketize, which does not vectorise).
    """
    idx = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for i, t in enumerate(_MIDPOINTS):
        # between indices i and i+1 the tie goes down when i is even, up when i is odd (even codes: 0, 1, 2, 4)
        idx += (mag > t) if i % 2 == 0 else (mag >= t)
    return idx


def e2m1_round_stochastic(mag: torch.Tensor, u24: torch.Tensor) -> torch.Tensor:
    """Magnitude index 0..7 of |v| <= 6, rounded up with probability (v - lo) / (hi - lo)."""
    lo = torch.zeros(mag.shape, dtype=torch.long, device=mag.device)
    for m in E2M1_MAGNITUDES[1:]:
        lo += mag >= m
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=mag.device)
    inv_step = torch.tensor(_INV_STEP, dtype=torch.float32, device=mag.device)
    frac = (mag - mags[lo]) * inv_step[lo]
    up = (u24.to(torch.float32) * 2.0 ** -24) < frac
    return (lo + up.long()).to(torch.uint8)


def _validate(x, block, scale_scope, rounding, check_finite: bool = True, check_shape: bool = True) -> tuple[int, int]:
    """One-line errors for a bad quantiser input; check_shape=False leaves out the multiples of 16 (a caller that
    pads inside checked its own shapes)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if block not in (BLOCK_1D, BLOCK_2D):
        raise ValueError(f"block must be (1, 16) or (16, 16), got {block}")
    rows, cols = x.shape
    if check_shape and cols % 16:
        raise ValueError(f"the last dim (K) must be a multiple of 16, got shape {tuple(x.shape)}")
    if check_shape and block == BLOCK_2D and rows % 16:
        raise ValueError(f"(16, 16) blocks need both dims to be multiples of 16, got shape {tuple(x.shape)}")
    if scale_scope not in ("tensor", "row"):
        raise ValueError(f"scale_scope must be 'tensor' or 'row', got {scale_scope!r}")
    if scale_scope == "row" and block == BLOCK_2D:
        raise ValueError("scale_scope='row' needs (1, 16) blocks: a 16x16 block spans 16 rows")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise NonFiniteError("quantize input contains NaN or Inf")
    return rows, cols


def quantize(x: torch.Tensor, *, block=BLOCK_1D, scale_scope: str = "tensor", rounding: str = "nearest",
             seed: int | None = None, rht: bool = False, backend: str = "auto", values: bool = False,
             check_finite: bool = True, global_amax: torch.Tensor | None = None,
             finite_flag: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantise a 2-D float tensor along its last dim to NVFP4 (see the module docstring for the exact math).

    block: (1, 16) or (16, 16). scale_scope: "tensor" or "row" (row needs (1, 16) blocks).
    rounding: "nearest" or "stochastic" (reproducible from `seed`, an int in [0, 2^32); None draws one from torch's
    global generator). rht: apply the 16-point random Hadamard transform along K first.
    backend: "auto" (Triton on CUDA tensors, else the reference), "reference", or "triton".
    values: also keep the fp16 block values (`NVFP4Tensor.values`) for the GEMM kernels; the Triton kernel writes
    them in the same pass. check_finite=False skips the NaN/Inf check, a host synchronisation on a GPU (the learner's
    GPU path skips it; a non-finite input then shows as a non-finite loss).
    global_amax: the amax of the global-scale scope (after the RHT when rht) as an fp32 tensor, 0-d for
    scale_scope="tensor" or [R] for "row", used instead of x's own: a shard of a tensor-parallel tensor passes the
    amax all-reduced over its group and quantises exactly as that slice of the whole tensor would. It must be at least
    x's own amax (a smaller one saturates).
    finite_flag: a NaN/Inf flag (fp32, one element, on x's device: minite.ops.FiniteFlag's) that takes max |x| for
    an input not checked here (check_finite=False): in the Triton kernel's own pass (NaN counted as +Inf), elsewhere
    by `fold_abs_max`; with rht, max |RHT(x)|, so a finite x whose transform overflows counts too.
    """
    block = tuple(block)
    _validate(x, block, scale_scope, rounding, check_finite)
    if global_amax is not None:
        want = (x.shape[0],) if scale_scope == "row" else ()
        if not torch.is_tensor(global_amax) or tuple(global_amax.shape) != want:
            raise ValueError(f"global_amax must be a tensor of shape {want} for scale_scope={scale_scope!r}, got "
                             f"{getattr(global_amax, 'shape', type(global_amax).__name__)}")
        global_amax = global_amax.to(device=x.device, dtype=torch.float32)
    elif x.numel() == 0 and (scale_scope == "tensor" or x.shape[1] == 0):  # no element to take an amax of
        raise ValueError(f"quantize got an empty tensor of shape {tuple(x.shape)}: its global scale needs at least "
                         "one element (pass global_amax, or skip the empty operand)")
    if rounding == "stochastic" and seed is None:
        seed = int(torch.randint(0, 2**32, ()).item())
    if seed is not None and not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must be in [0, 2^32), got {seed}")
    name, _ = resolve(backend, x, op="quantize")
    if name == "triton":
        q, vals = kernel("quantize_with_values")(x, block, scale_scope, rounding, seed, rht,
                                              values_dtype=torch.float16 if values else None,
                                              global_amax=global_amax, flag=finite_flag)
        q.values = vals
        return q
    if finite_flag is not None:  # what the kernel's pass sees: the transformed values with the RHT
        fold_abs_max(finite_flag, apply_rht(x) if rht else x)
    q = quantize_reference(x, block=block, scale_scope=scale_scope, rounding=rounding, seed=seed, rht=rht,
                           global_amax=global_amax)
    if values:
        q.values = q.block_values(torch.float16)
    return q


def fold_abs_max(flag: torch.Tensor, x: torch.Tensor) -> None:
    """flag = max(flag, max |x|) in place, in torch ops (a NaN anywhere makes the flag NaN, an Inf keeps it +Inf): a
    NaN/Inf flag's record where no kernel takes it (minite.ops.FiniteFlag); an empty x leaves it."""
    if x.numel():
        amax = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dtype=torch.float32)
        torch.maximum(flag, amax.to(flag.device), out=flag)


def quantize_reference(x: torch.Tensor, *, block, scale_scope: str, rounding: str, seed: int | None,
                       rht: bool, global_amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """The pure-PyTorch reference (inputs already validated)."""
    rows, cols = x.shape
    br = block[0]
    xf = apply_rht(x) if rht else x.float()
    ax = xf.abs()
    if global_amax is not None:
        amax = global_amax.float()
    else:
        amax = ax.amax(dim=1) if scale_scope == "row" else ax.amax()
    s_enc = global_encode_scale(amax)
    s_dec = torch.tensor(1.0, dtype=torch.float32) / s_enc
    # per-block amax over (br x 16) tiles -> [rows / br, cols / 16]
    block_amax = ax.reshape(rows // br, br, cols // 16, 16).amax(dim=(1, 3))
    s_enc_b = s_enc[:, None] if scale_scope == "row" else s_enc
    s_dec_b = s_dec[:, None] if scale_scope == "row" else s_dec
    sixth = torch.tensor(1.0, dtype=torch.float32) / E2M1_MAX
    scale = torch.clamp(block_amax * (s_enc_b * sixth), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    mult = torch.clamp(torch.tensor(1.0) / (scale.float() * s_dec_b), max=FP32_MAX)
    blocks = xf.reshape(rows // br, br, cols // 16, 16) * mult[:, None, :, None]
    v = torch.clamp(blocks.reshape(rows, cols), -E2M1_MAX, E2M1_MAX)
    if rounding == "stochastic":
        index = torch.arange(rows * cols, device=x.device).reshape(rows, cols)
        mag_idx = e2m1_round_stochastic(v.abs(), uniform_u24(int(seed), index))
    else:
        mag_idx = e2m1_round_nearest(v.abs())
    # x < 0, as TE's reference tests it: -0.0 gets code 0, a negative value that rounds to zero code 8 (docs/nvfp4.md)
    codes = mag_idx | ((v < 0).to(torch.uint8) * SIGN_BIT)
    return NVFP4Tensor(data=pack_codes(codes), scale=scale, global_scale=s_dec.to(torch.float32),
                       shape=(rows, cols), block=block, amax=decode_amax(amax, s_enc))
