"""An independent scalar model of NVFP4 quantisation, element by element in numpy float32.

It shares no code with minite.nvfp4 (E4M3 rounding is done by hand here, not by torch's cast), so agreement between
the two is evidence about both. Slow: small shapes only.
"""
import math

import numpy as np

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)
MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_rne(v: float) -> float:
    """Round a non-negative value <= 448 to E4M3 (3 mantissa bits, min normal 2^-6, subnormal step 2^-9)."""
    if v == 0:
        return 0.0
    e = max(math.floor(math.log2(v)), -6)
    step = 2.0 ** (e - 3)
    q = v / step
    r = math.floor(q)
    frac = q - r
    if frac > 0.5 or (frac == 0.5 and r % 2 == 1):
        r += 1
    return min(r * step, 448.0)


def e2m1_index(m: float) -> int:
    """Nearest magnitude index, ties to the even index."""
    best = 0
    for i, mag in enumerate(MAGS):
        d, db = abs(m - mag), abs(m - MAGS[best])
        if d < db or (d == db and i % 2 == 0 and best % 2 == 1):
            best = i
    return best


def quantize_scalar(x: np.ndarray, block_rows: int, per_row: bool):
    """(codes [R, C] int, scales [R/br, C/16] float, s_dec scalar or [R]) for round-to-nearest, no RHT."""
    x = x.astype(np.float32)
    rows, cols = x.shape
    amax = np.abs(x).max(axis=1) if per_row else np.array([np.abs(x).max()])
    s_enc = np.empty_like(amax)
    for i, a in enumerate(amax):
        s = F(2688.0) / a if a != 0 else F(np.inf)
        s = min(s, FLT_MAX)
        s_enc[i] = F(1.0) if (a == 0 or s == 0) else s
    s_dec = (F(1.0) / s_enc).astype(np.float32)
    sixth = F(1.0) / F(6.0)
    codes = np.zeros((rows, cols), dtype=np.int64)
    scales = np.zeros((rows // block_rows, cols // 16))
    for bi in range(rows // block_rows):
        for bj in range(cols // 16):
            blk = x[bi * block_rows:(bi + 1) * block_rows, bj * 16:(bj + 1) * 16]
            g = bi * block_rows if per_row else 0
            enc, dec = s_enc[g if per_row else 0], s_dec[g if per_row else 0]
            raw = F(F(np.abs(blk).max()) * F(enc * sixth))
            sb = e4m3_rne(float(min(max(raw, F(-448)), F(448))))
            scales[bi, bj] = sb
            denom = F(F(sb) * dec)
            mult = FLT_MAX if denom == 0 else min(F(F(1.0) / denom), FLT_MAX)
            for r in range(blk.shape[0]):
                for c in range(16):
                    v = F(blk[r, c] * F(mult))
                    v = min(max(v, F(-6)), F(6))
                    code = e2m1_index(abs(float(v)))
                    if v < 0:  # TE's sign test: -0.0 keeps code 0
                        code |= 8
                    codes[bi * block_rows + r, bj * 16 + c] = code
    return codes, scales, (s_dec if per_row else s_dec[0])
