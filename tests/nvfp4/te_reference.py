"""Transformer Engine's NVFP4 arithmetic, written independently of minite from TE's published formulas.

Sources (read, not copied): TE's pure-PyTorch reference quantiser (`transformer_engine/pytorch/custom_recipes/
reference_nvfp4.py`, NVFP4QuantizerRef), its per-tensor-scale kernel (`compute_nvfp4_per_tensor_scale_kernel`:
alpha = alpha_in * amax_A * amax_B * factor_inv) and its NVFP4 tests (dequantised value = e2m1 * s * (amax / 2688)).
The tests compare minite.nvfp4 and the kernels with these functions bit for bit. The implementation choices differ
from minite's on purpose, so that agreement is evidence: the E2M1 code comes from TE's interval table (inclusive /
exclusive bounds) rather than from rounding, the E4M3 cast is torch's, the RHT is emulated in float64.

Where minite deliberately differs from TE, the functions here say so and the tests compare only the agreed part:
- amax == 0: TE's S_enc is FLT_MAX (2688 / 0 clamped), minite's is 1; the codes and block scales are all zero either
  way, so only the global scale differs (`te_global_scales` returns TE's, the tests skip those rows).
- S_enc saturated (amax < 2688 / FLT_MAX): TE's alpha uses the raw amax, minite's the saturated amax 2688 / FLT_MAX
  (docs/nvfp4.md); the tests of alpha use amaxes above that bound.
"""
from __future__ import annotations

import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
SIGNS = [1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _hadamard16() -> torch.Tensor:
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return torch.tensor(h, dtype=torch.float64)


def _rht_matrix() -> torch.Tensor:
    return torch.diag(torch.tensor(SIGNS, dtype=torch.float64)) @ _hadamard16() * 0.25  # entries +-1/4, exact


def te_rht(x: torch.Tensor) -> torch.Tensor:
    """TE's x_groups @ (diag(signs) @ H16 * (1/sqrt(16))) in x's dtype, as fp32 values: a matmul in x's dtype with
    fp32 accumulation over the 16 inputs in order, each step a fused multiply-add (the exact product added, one
    rounding), then one rounding to x's dtype. Emulated in float64: each product and each step's sum is exact there
    for the tests' inputs, then rounded to fp32."""
    rows, cols = x.shape
    m = _rht_matrix()
    g = x.double().reshape(-1, 16)
    acc = torch.zeros_like(g)
    for i in range(16):
        acc = (acc + g[:, i:i + 1] * m[i]).float().double()
    return acc.reshape(rows, cols).float().to(x.dtype).float()


def exact_rht(x: torch.Tensor) -> torch.Tensor:
    """The exact transform rounded once to fp32 (then to x's dtype): minite's documented result for fp32 subnormal
    inputs, where TE's per-step rounding of products x * 1/4 below 2^-126 can differ by an ulp."""
    rows, cols = x.shape
    y = (x.double().reshape(-1, 16) @ _rht_matrix()).reshape(rows, cols)
    return y.float().to(x.dtype).float()


def te_cast_to_fp4(v: torch.Tensor) -> torch.Tensor:
    """TE's cast_to_fp4x2 before packing: code per element of v (fp32, already clipped to [-6, 6]).

    The intervals: [0, .25] -> 0, (.25, .75) -> 1, [.75, 1.25] -> 2, (1.25, 1.75) -> 3, [1.75, 2.5] -> 4,
    (2.5, 3.5) -> 5, [3.5, 5] -> 6, (5, 6] -> 7, mirrored with code | 8 for v < 0 (so -0.0 is code 0)."""
    mag = v.abs()
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    idx = torch.zeros(v.shape, dtype=torch.uint8)
    for b, inclusive_above in bounds:
        # an inclusive lower bound of the next interval moves the tie up
        idx += (mag >= b) if inclusive_above else (mag > b)
    return idx | ((v < 0).to(torch.uint8) << 3)


def te_global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) as TE's reference: min(448 * 6 / amax, FLT_MAX) (0 -> 1), 1 / S_enc; fp32."""
    s = torch.minimum(torch.tensor(448.0 * 6.0) / amax, torch.tensor(FLT_MAX))
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s, torch.tensor(1.0) / s


def te_quantize(x: torch.Tensor, tile=(1, 16), row_scaled: bool = False, rht: bool = False):
    """TE's round-to-nearest NVFP4 quantisation of x [R, C] along C: (codes uint8 [R, C], block scales e4m3
    [R / tile_rows, C / 16], amax fp32 [] or [R], S_dec fp32 [] or [R])."""
    xs = te_rht(x) if rht else x.float()
    rows, cols = xs.shape
    tr = tile[0]
    amax = xs.abs().amax(dim=1) if row_scaled else xs.abs().amax()
    s_enc, s_dec = te_global_scales(amax)
    blocks = xs.abs().reshape(rows // tr, tr, cols // 16, 16).amax(dim=(1, 3))  # [R/tr, C/16]
    if row_scaled:
        s_enc_b, s_dec_b = s_enc[:, None], s_dec[:, None]
    else:
        s_enc_b, s_dec_b = s_enc, s_dec
    mult = s_enc_b * torch.reciprocal(torch.tensor(6.0))  # TE folds 1/6 into the global multiplier
    scale = torch.clamp(torch.minimum(blocks * mult, torch.tensor(FLT_MAX)), -448.0, 448.0).to(torch.float8_e4m3fn)
    enc = torch.minimum(torch.tensor(1.0) / (scale.float() * s_dec_b), torch.tensor(FLT_MAX))
    enc_el = enc.repeat_interleave(tr, dim=0).repeat_interleave(16, dim=1)
    codes = te_cast_to_fp4(torch.clamp(xs * enc_el, -6.0, 6.0))
    return codes, scale, amax, s_dec


def te_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """TE's GEMM alpha with alpha_in = 1: ((1 * amax_A) * amax_B) * factor_inv, factor_inv the fp32 rounding of
    1 / (6 * 6 * 448 * 448); broadcast as given (per-row amaxes: the row-scaled reference's per-row alpha)."""
    factor_inv = torch.tensor(1.0 / (6.0 * 6.0 * 448.0 * 448.0), dtype=torch.float32)
    return ((torch.tensor(1.0) * amax_a) * amax_b) * factor_inv


def te_block_values(codes: torch.Tensor, scale: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    """e2m1 * s in fp32 (exact), elementwise."""
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float32)
    s = scale.float().repeat_interleave(tile_rows, dim=0).repeat_interleave(16, dim=1)
    return table[codes.long()] * s


def te_dequantize(codes, scale, amax, tile_rows: int = 1) -> torch.Tensor:
    """TE's test formula and ModelOpt's: (e2m1 * s) * fl(amax / 2688), fp32."""
    d = amax / torch.tensor(2688.0)
    return te_block_values(codes, scale, tile_rows) * (d[:, None] if d.dim() else d)


def te_gemm(codes_a, scale_a, amax_a, codes_b, scale_b, amax_b, b_tile_rows: int = 1) -> torch.Tensor:
    """fl32(exact sum of block-value products) * alpha: a @ b^T for a [M, K], b [N, K] (per-row amax_a allowed)."""
    va = te_block_values(codes_a, scale_a).double()
    vb = te_block_values(codes_b, scale_b, b_tile_rows).double()
    acc = (va @ vb.t()).float()
    am_a = amax_a[:, None] if amax_a.dim() else amax_a
    return acc * te_alpha(am_a, amax_b)


def make_inputs(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random, heavy-tailed and special values (zero blocks, an all-zero row, E2M1 and E4M3 ties, tiny and large
    magnitudes) in `dtype`; rows a multiple of 16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[rows // 4: rows // 2] *= torch.exp(torch.randn(rows // 4, cols, generator=g) * 3)  # heavy tails
    x[:, 16:32] = 0.0  # a zero block column
    x[1] = 0.0  # an all-zero row (row-scaled: amax 0)
    x[2, :16] = torch.tensor([10.5] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2 + [-6.0])  # E2M1 ties at mult 1
    x[3] *= 1e-30  # tiny row
    x[4] *= 1e30  # large row
    x[5, ::2] = -0.0
    return x.to(dtype)


def flat_block_inputs(rows: int, cols: int, tile_rows: int, per_row: bool, seed: int) -> torch.Tensor:
    """fp32 inputs whose every block (1 x 16, or 16 x 16 when tile_rows = 16) holds the amax of its global-scale scope
    (its row when per_row, else the tensor), so every block scale of a scope is the same E4M3 value s. Then a GEMM's
    fp32 accumulation is exact (a partial sum is s_a * s_b times a multiple of 1/4 below 2^16 for K <= 256, at most
    24 significant bits), and a kernel's output must equal te_gemm bit for bit: this pins the alpha epilogue."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    amax = torch.exp(torch.randn(rows if per_row else 1, generator=g) * 3) * 4  # amaxes over ~e^+-9
    x = x / x.abs().amax(dim=1, keepdim=True) * (amax[:, None] if per_row else amax) * 0.99
    top = amax[:, None] if per_row else amax.expand(rows)[:, None]
    sign = torch.where(torch.rand(rows, cols // 16, generator=g) < 0.5, -1.0, 1.0)
    x[::tile_rows, ::16] = (top * sign)[::tile_rows]
    return x
