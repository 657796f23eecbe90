"""The element encodings of the NVFP4 quantisation kernels (kernels/nvfp4_quant.py), in Triton and, on the GPU, PTX.

Why bit arithmetic for the casts: Hopper has no E2M1 convert, and Triton's interpreter gets fp32 -> float8e4nv wrong
(carry, ties, saturation, subnormals; docs/nvfp4.md, "Triton's CPU interpreter"). The E4M3 rounding here adds
0x7FFFF + lsb to the fp32 bits and truncates 20 mantissa bits (round to nearest even), and rounds subnormals
(< 2^-6) with the 1.5 * 2^23 magic-number add. E2M1 (`_e2m1_nearest`, `_e2m1_stochastic`) works on the fp32 bits
of |v| too: at 1 and above, E2M1 is fp32 with one mantissa bit (round: add 0x1FFFFF + lsb, clear 22 bits; stochastic:
truncate, and compare the 24 random bits with the 22 bits cut off, in integers); below 1 the step is 0.5 (2|v| +
2^23 in one rounding). The code index and the block value come off the rounded bits, with no float -> int
conversion and no comparison against a table of midpoints. All of it is exact on the GPU and in the interpreter.
Every fp32 multiply/divide mirrors one in the reference; the possible fma contraction (x*s + acc in the RHT,
v*512 + C and 2|v| + 2^23 in the roundings) changes nothing because each product is exact.
On the GPU the E2M1 encoding of a pair, TE's sign test and the nibble packing run as one PTX block
(`_pair_ptx`, below; nearest-even and stochastic): the quantisers were bound by the integer ALU pipe on the H200
(ncu, 2026-12-04: row-scope RNE 78% ALU against 22% FMA, stochastic 89%), and the PTX moves that work to fp32 adds
(rounded to nearest, or toward +inf for stochastic rounding) and integer multiply-adds, the FMA pipe. The interpreter
runs the Triton encoding (`_encode_pairs`), the same bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._interpreter import interpreting

# The E2M1 encoding of a pair on the GPU, in PTX that keeps the integer ALU free (the quantisers were bound by that
# pipe on the H200: ncu, docs/benchmarks.md issue 17, session 21): per element a = min(|v|, 6); M = 2^22 x 2^e, e the
# exponent of max(a, 1), whose fp32 ulp is the E2M1 step at a (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), so a + M rounds
# a to the E2M1 grid in one IEEE rounding, nearest-even, and (a + M) - M is the rounded magnitude r (exact); r x
# 2^-126 is an fp32 whose bits are the E2M1 code shifted left by 22 (2-bit exponent, 1 mantissa bit, its subnormal 0.5
# at 2^-127: no flush to zero here). The sign is TE's v < 0: v + 0 turns -0 into +0 (NaN has no sign after an add),
# and its top bit is the sign. The byte (even element in the low nibble) is then (t_e + 16 t_o) >> 22 plus 8 and 128
# times the signs, in integer multiply-adds and high multiplies (the FMA pipe) instead of shifts, masks and selects.
# Every rounding is spelled (.rn; .rp below) so that ptxas cannot contract a multiply into an add. Bits equal to
# `_e2m1_nearest` (tests/kernels/test_quant.py runs this PTX text in tests/kernels/ptx_interpreter.py for every 61st
# fp32 in [0, 6] and the E2M1 neighbourhoods; the GPU tests compare the compiled kernels with the reference). $0: the
# byte; with values, $1/$2 the signed rounded magnitudes, a negative one rounded to 0 as +0 (+ 0 after the sign), as
# the Triton encoding (0 - x) and kernels/nvfp4_values.py write code 8's value (tests/kernels/test_grouped.py compares
# the bits).
# Per element a = min(|v|, 6) and me = 2^e (e the exponent of max(a, 1)), for either rounding below
_E2M1_MAGNITUDES = """
.reg .f32 ae, ao, me, mo, se, so, re, ro, te, to, ze, zo;
.reg .b32 be, bo, ue, uo, w, s;
abs.f32 ae, $VE;
min.f32 ae, ae, 0f40C00000;
abs.f32 ao, $VO;
min.f32 ao, ao, 0f40C00000;
max.f32 me, ae, 0f3F800000;
max.f32 mo, ao, 0f3F800000;
mov.b32 be, me;
mov.b32 bo, mo;
and.b32 be, be, 0x7F800000;
and.b32 bo, bo, 0x7F800000;
mov.b32 me, be;
mov.b32 mo, bo;
"""
# Nearest-even: the rounded magnitudes re, ro
_E2M1_NEAREST = """
mul.rn.f32 me, me, 0f4A800000;
mul.rn.f32 mo, mo, 0f4A800000;
add.rn.f32 se, ae, me;
add.rn.f32 so, ao, mo;
sub.rn.f32 re, se, me;
sub.rn.f32 ro, so, mo;
"""
# Stochastic rounding of a pair from 24 random bits k each ($KE, $KO), the same bits as `_e2m1_stochastic` and the
# reference: with step the E2M1 spacing above the grid point lo <= a (2^e x 2^-1, e as above) the reference rounds
# up iff k x 2^-24 < (a - lo) / step, i.e. iff a - w > lo for w = k x 2^-24 x step (exact: k has 24 bits and the
# factor is a power of two). So r = ceil_grid(a - w): a - w rounded toward +inf in fp32 (a grid point is an fp32,
# so the directed rounding cannot cross one: a - w > lo iff rp(a - w) > lo), clamped at 0 (a - w > lo - step >= 0
# except where lo = 0), then + M rounded toward +inf to the step of M's binade (the grid), - M exact. At a = 6 (lo =
# 6, step 2) a - w lies in (4, 6] and r = 6: no rounding up past the grid's end, as in the reference. Tested as the
# nearest-even block is, with each magnitude's random bits at its threshold (test_ptx_stochastic_pair_encoding_...).
_E2M1_STOCHASTIC = """
.reg .f32 we, wo, he, ho;
cvt.rn.f32.u32 we, $KE;
cvt.rn.f32.u32 wo, $KO;
mul.rn.f32 he, me, 0f33000000;
mul.rn.f32 ho, mo, 0f33000000;
mul.rn.f32 we, we, he;
mul.rn.f32 wo, wo, ho;
mul.rn.f32 me, me, 0f4A800000;
mul.rn.f32 mo, mo, 0f4A800000;
sub.rp.f32 se, ae, we;
sub.rp.f32 so, ao, wo;
max.f32 se, se, 0f00000000;
max.f32 so, so, 0f00000000;
add.rp.f32 se, se, me;
add.rp.f32 so, so, mo;
sub.rn.f32 re, se, me;
sub.rn.f32 ro, so, mo;
"""
# The code bits, TE's sign and the byte from the rounded magnitudes re, ro (either rounding above).
_E2M1_PACK = """
mul.rn.f32 te, re, 0f00800000;
mul.rn.f32 to, ro, 0f00800000;
mov.b32 be, te;
mov.b32 bo, to;
mad.lo.u32 w, bo, 16, be;
mul.hi.u32 w, w, 1024;
add.rn.f32 ze, $VE, 0f00000000;
add.rn.f32 zo, $VO, 0f00000000;
mov.b32 ue, ze;
mov.b32 uo, zo;
mul.hi.u32 s, ue, 2;
mad.lo.u32 w, s, 8, w;
mul.hi.u32 s, uo, 2;
mad.lo.u32 $0, s, 128, w;
"""
# with values: the signed rounded magnitudes into $1, $2, a negative one rounded to 0 as +0 (+ 0 after the sign)
_E2M1_VALUES = """
.reg .b32 rb;
.reg .f32 rs;
and.b32 ue, ue, 0x80000000;
mov.b32 rb, re;
or.b32 rb, rb, ue;
mov.b32 rs, rb;
add.rn.f32 $1, rs, 0f00000000;
and.b32 uo, uo, 0x80000000;
mov.b32 rb, ro;
or.b32 rb, rb, uo;
mov.b32 rs, rb;
add.rn.f32 $2, rs, 0f00000000;
"""


def _pair_ptx(rounding: str, values: bool) -> tl.constexpr:
    """The PTX block of one pair: operands $0 (byte)[, $1 $2 (values)], then the even and odd scaled elements, then
    (stochastic) their 24 random bits."""
    body = _E2M1_MAGNITUDES + (_E2M1_STOCHASTIC if rounding == "stochastic" else _E2M1_NEAREST) + _E2M1_PACK
    if values:
        body += _E2M1_VALUES
    first = 3 if values else 1
    for i, name in enumerate(("$VE", "$VO", "$KE", "$KO")):
        body = body.replace(name, f"${first + i}")
    return tl.constexpr("{" + body + "}")


_E2M1_PAIR_PTX = _pair_ptx("nearest", False)
_E2M1_PAIR_VALUES_PTX = _pair_ptx("nearest", True)
_E2M1_SR_PAIR_PTX = _pair_ptx("stochastic", False)
_E2M1_SR_PAIR_VALUES_PTX = _pair_ptx("stochastic", True)
_PTX = tl.constexpr(not interpreting())
"""Encode pairs with the PTX of `_pair_ptx` in compiled kernels; the interpreter runs the Triton encoding of
`_encode_pairs`, the same bits (a module constant, read when a kernel compiles: one process compiles one of the two
encodings, so a benchmark compares them across commits, not in one run)."""


@triton.jit
def _lowbias32(x):
    """Bijective uint32 mixer; identical to minite.nvfp4.quantize._lowbias32 (uint32 multiply wraps mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _e4m3_rne(v):
    """E4M3 code (int32) and its fp32 value for 0 <= v <= 448, rounding to nearest even; for a NaN v, E4M3's NaN
    (code 0x7F) and a NaN value, as torch's cast of a NaN block scale (the reference's)."""
    bits = v.to(tl.int32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    code_n = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # below 2^-6 the step is 2^-9: round v * 2^9 to an integer with the 1.5 * 2^23 magic number (nearest even)
    q = (v * 512.0 + 12582912.0) - 12582912.0
    code = tl.where(v < 0.015625, q.to(tl.int32), code_n)
    e = code >> 3
    m = code & 7
    val_n = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, val_n)
    nan = v != v
    return tl.where(nan, 0x7F, code), tl.where(nan, v, val)


@triton.jit
def _e2m1_nearest(mag):
    """(E2M1 magnitude index, its fp32 value) of 0 <= mag <= 6, nearest-even, from the fp32 bits: no comparison
    against the midpoints and no float -> int conversion (the conversions run at 1/8 of the FMA rate on Hopper).
    mag >= 1 (the E2M1 normals 1..6, one mantissa bit): the fp32 bits rounded to one mantissa bit, nearest-even
    (add 0x1FFFFF + that bit's lsb, clear the 22 bits below; a carry moves to the next binade, 1.75 -> 2), and the
    index is (bits >> 22) - 252 = 2 * (exp - 126) + mantissa bit. mag < 1 (step 0.5: 0, 0.5, 1): 2 * mag + 2^23 in
    one IEEE rounding (2 * mag is exact, so an fma changes nothing) puts round-half-even(2 * mag) in the low bits."""
    bits = mag.to(tl.int32, bitcast=True)
    r = (bits + (0x1FFFFF + ((bits >> 22) & 1))) & -4194304  # -4194304 = 0xFFC00000
    f = mag * 2.0 + 8388608.0
    sub = mag < 1.0
    idx = tl.where(sub, f.to(tl.int32, bitcast=True) - 0x4B000000, (r >> 22) - 252)
    return idx, tl.where(sub, f * 0.5 - 4194304.0, r.to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_stochastic(mag, k):
    """(E2M1 magnitude index, its fp32 value) of 0 <= mag <= 6 rounded up from the grid point below with probability
    (mag - lo) / (hi - lo), up when k * 2^-24 < that fraction (k: 24 random bits, int32), as the reference.
    mag >= 1: lo is mag's fp32 bits truncated to one mantissa bit and the fraction is exactly the 22 bits L below it
    over 2^22, so up iff k < 4 L iff (k >> 2) < L iff L + (2^22 - 1 - (k >> 2)) carries into bit 22: the bits plus
    (k >> 2) ^ 0x3FFFFF, truncated, are the rounded value (a carry into the exponent is 1.5 -> 2; 6 has L = 0 and
    never rounds up). mag < 1: t = 2 * mag (exact), lo = t >= 1, fraction t - lo (exact), compared in fp32 as the
    reference does; lo and up stay fp32 (0 or 1), and lo + up + 2^23 puts the index in the low bits, as in
    `_e2m1_nearest`. The interpreter runs this; compiled kernels run `_E2M1_STOCHASTIC` (PTX, the same bits). (When
    the GPU still ran it: integer 0/1 arithmetic here compiled to packed 16-bit lanes and byte permutes, and the
    compare and select of the normal branch cost more; the tensor-scope quantiser with stochastic rounding took 26.5
    more instructions per element than with nearest-even on sm_90, 16.0 in this form: sass_census.py --quant.)"""
    bits = mag.to(tl.int32, bitcast=True)
    r = (bits + ((k >> 2) ^ 0x3FFFFF)) & -4194304  # -4194304 = 0xFFC00000
    t = mag * 2.0
    lo = tl.where(t >= 1.0, 1.0, 0.0)
    up = tl.where((k.to(tl.float32) * 5.9604644775390625e-08) < (t - lo), 1.0, 0.0)  # * 2^-24
    idx_s = lo + up
    sub = mag < 1.0
    f = idx_s + 8388608.0
    idx = tl.where(sub, f.to(tl.int32, bitcast=True) - 0x4B000000, (r >> 22) - 252)
    return idx, tl.where(sub, idx_s * 0.5, r.to(tl.float32, bitcast=True))


_F16X2_PTX = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")
_BF16X2_PTX = tl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")


@triton.jit
def _values_word(e, o, dtype: tl.constexpr):
    """The 32-bit word of two block values in `dtype`, the even element e in the low half. A block value (an E2M1
    magnitude times an E4M3 scale: at most 6 significant bits, between 2^-10 and 2688) is exact in fp16 and bf16,
    so no rounding acts. On the GPU one packing convert a pair (cvt.rn.f16x2.f32, bf16x2) instead of two converts,
    a shift and an or."""
    if _PTX and dtype == tl.float16:
        return tl.inline_asm_elementwise(_F16X2_PTX, "=r,f,f", [e, o], dtype=tl.uint32, is_pure=True, pack=1)
    elif _PTX and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_BF16X2_PTX, "=r,f,f", [e, o], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        ev = e.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32)
        return ev | (o.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _random_u24(rows, c0, C, seed_mix, G: tl.constexpr):
    """The 24 random bits (int32) of each element of a [BLOCK_R, G, 8, 2] tile: the counter hash of its flat index
    rows * C + column, as minite.nvfp4.quantize.uniform_u24."""
    g = tl.arange(0, G)
    jj = tl.arange(0, 8)
    pp = tl.arange(0, 2)
    col = (c0 + g * 16)[None, :, None, None] + jj[None, None, :, None] * 2 + pp[None, None, None, :]
    # (flat index + mix) mod 2^32 computed directly in wrapping uint32 arithmetic (cheaper than int64)
    flat = rows[:, None, None, None].to(tl.uint32) * C.to(tl.uint32) + col.to(tl.uint32)
    # seed_mix arrives as its int32 bit pattern; the hash's shifts stay shifts (as high multiplies in PTX, on the
    # FMA pipe, tensor-scope SR took 611 against 564 us, and again 554 against 490 us once the PTX encoding had
    # raised its occupancy: H200, sessions 21 and 22)
    h = _lowbias32(flat + seed_mix.to(tl.uint32, bitcast=True))
    return (h >> 8).to(tl.int32)


@triton.jit
def _encode_pairs(v, rows, c0, C, seed_mix, G: tl.constexpr, STOCHASTIC: tl.constexpr, VALUES: tl.constexpr):
    """(byte, signed rounded magnitude of the even / odd elements) of a scaled [BLOCK_R, G, 8, 2] tile v: E2M1 codes,
    even element in the low nibble, nearest-even or stochastic from the counter hash. The magnitudes are meaningful
    only with VALUES (unused otherwise, and compiled away). On the GPU one PTX block per pair (`_pair_ptx`); the
    Triton encoding below runs in the interpreter, the same bits."""
    if _PTX:
        ve, vo = tl.split(v)  # [BLOCK_R, G, 8] each: even element in the low nibble
        if STOCHASTIC:
            ke, ko = tl.split(_random_u24(rows, c0, C, seed_mix, G))
            if VALUES:
                byte, re, ro = tl.inline_asm_elementwise(_E2M1_SR_PAIR_VALUES_PTX, "=r,=f,=f,f,f,r,r", [ve, vo, ke, ko],
                                                         dtype=(tl.int32, tl.float32, tl.float32), is_pure=True,
                                                         pack=1)
                return byte.to(tl.uint8), re, ro
            byte = tl.inline_asm_elementwise(_E2M1_SR_PAIR_PTX, "=r,f,f,r,r", [ve, vo, ke, ko], dtype=tl.int32,
                                             is_pure=True, pack=1)
            return byte.to(tl.uint8), ve, vo  # (ve, vo: placeholders, not magnitudes)
        if VALUES:
            byte, re, ro = tl.inline_asm_elementwise(_E2M1_PAIR_VALUES_PTX, "=r,=f,=f,f,f", [ve, vo],
                                                     dtype=(tl.int32, tl.float32, tl.float32), is_pure=True, pack=1)
            return byte.to(tl.uint8), re, ro
        byte = tl.inline_asm_elementwise(_E2M1_PAIR_PTX, "=r,f,f", [ve, vo], dtype=tl.int32, is_pure=True, pack=1)
        return byte.to(tl.uint8), ve, vo  # (ve, vo: placeholders, not magnitudes)
    mag = tl.minimum(tl.abs(v), 6.0)  # |clamp(v, -6, 6)|
    if STOCHASTIC:
        idx, rounded = _e2m1_stochastic(mag, _random_u24(rows, c0, C, seed_mix, G))
    else:
        idx, rounded = _e2m1_nearest(mag)
    neg = v < 0.0  # TE's sign test: -0.0 gets code 0, a negative value rounding to zero code 8 (docs/nvfp4.md)
    code = idx | (neg.to(tl.int32) << 3)
    even, odd = tl.split(code)  # [BLOCK_R, G, 8] each: even element in the low nibble
    # 0 - x, not -x: code 8's block value is +0 on every Triton version (3.6 compiled -x as 0 - x, 3.9 flips the sign)
    # and in the interpreter, as the PTX and kernels/nvfp4_values.py write it
    re, ro = tl.split(tl.where(neg, 0.0 - rounded, rounded))
    return (even | (odd << 4)).to(tl.uint8), re, ro
