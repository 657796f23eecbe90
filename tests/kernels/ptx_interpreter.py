"""A numpy interpreter of the inline-PTX subset the kernels use, so that CPU tests run the very PTX text the GPU
compiles: kernels/nvfp4_gemm.py's packed decode (`_E2M1_X2_PTX`, tests/kernels/test_ptx_decode.py) and
kernels/nvfp4_encode.py's E2M1 pair encodings, nearest-even and stochastic (`_pair_ptx`, tests/kernels/test_quant.py).

Registers hold 32 bits (uint32 arrays, one lane per element). PTX's semantics for the subset: u32 arithmetic wraps;
.f32 arithmetic is IEEE fp32 with subnormals kept (no `.ftz`), rounded to nearest (`.rn`) or toward +inf (`.rp`: the
nearest sum, moved up one ulp where its exact error, from Knuth's TwoSum in fp32, is positive); cvt.rn.f32.u32 rounds
to nearest; min/max return the non-NaN operand (numpy's fmin/fmax); prmt picks bytes of its two sources by an
immediate selector, with PTX's sign-replicate mode. An opcode outside the subset raises NotImplementedError, so a
kernel's PTX cannot grow past what its test checks."""
from __future__ import annotations

import numpy as np

U32, F32 = np.uint32, np.float32


def prmt(a, b, sel: int) -> np.ndarray:
    """prmt.b32 d, a, b, sel: byte i of d is byte (sel >> 4i) & 7 of b:a, or its sign replicated when bit 3 is set."""
    a, b = np.asarray(a, U32), np.asarray(b, U32)
    out = np.zeros(np.broadcast(a, b).shape, U32)
    for i in range(4):
        n = (int(sel) >> 4 * i) & 0xF
        byte = ((a if n & 7 < 4 else b) >> U32(8 * (n & 3))) & U32(0xFF)
        if n & 8:
            byte = np.where(byte & U32(0x80), U32(0xFF), U32(0))
        out |= byte.astype(U32) << U32(8 * i)
    return out


def _f(x) -> np.ndarray:
    return np.asarray(x, U32).view(F32)


def _u(x) -> np.ndarray:
    return np.asarray(x, F32).view(U32)


def _add_rp(a, b) -> np.ndarray:
    """fp32 a + b rounded toward +inf: s = fl(a + b) and its exact error e (TwoSum: s + e = a + b exactly, for finite
    sums), then s, or the next fp32 up where e > 0; a finite sum that overflows to -inf under round-to-nearest is
    -FLT_MAX toward +inf (one that overflows to +inf stays +inf)."""
    a, b = _f(a), _f(b)
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    up = np.where(np.isfinite(s) & (e > 0), np.nextafter(s, F32(np.inf)), s)
    return _u(np.where((s == -np.inf) & np.isfinite(a) & np.isfinite(b), -np.finfo(F32).max, up).astype(F32))


def _wide(x) -> np.ndarray:
    return np.asarray(x, U32).astype(np.uint64)


OPS = {
    "prmt.b32": prmt,
    "mov.b32": lambda a: np.array(a, U32),
    "and.b32": lambda a, b: np.asarray(a, U32) & np.asarray(b, U32),
    "or.b32": lambda a, b: np.asarray(a, U32) | np.asarray(b, U32),
    "shl.b32": lambda a, b: ((_wide(a) << np.uint64(b)) & np.uint64(0xFFFFFFFF)).astype(U32),
    "mul.lo.u32": lambda a, b: ((_wide(a) * _wide(b)) & np.uint64(0xFFFFFFFF)).astype(U32),
    "mad.lo.u32": lambda a, b, c: ((_wide(a) * _wide(b) + _wide(c)) & np.uint64(0xFFFFFFFF)).astype(U32),
    "mul.hi.u32": lambda a, b: ((_wide(a) * _wide(b)) >> np.uint64(32)).astype(U32),
    "abs.f32": lambda a: _u(np.abs(_f(a))),
    "min.f32": lambda a, b: _u(np.fmin(_f(a), _f(b))),
    "max.f32": lambda a, b: _u(np.fmax(_f(a), _f(b))),
    "mul.rn.f32": lambda a, b: _u(_f(a) * _f(b)),
    "add.rn.f32": lambda a, b: _u(_f(a) + _f(b)),
    "sub.rn.f32": lambda a, b: _u(_f(a) - _f(b)),
    "add.rp.f32": _add_rp,
    "sub.rp.f32": lambda a, b: _add_rp(a, _u(-_f(b))),
    "cvt.rn.f32.u32": lambda a: _u(np.asarray(a, U32).astype(F32)),
}


def run_ptx(text: str, operands: dict) -> dict:
    """Execute `text` on `operands` ({"$N": uint32 array or int}); returns every register ($N and named) by name.
    Immediates: decimal, 0x hex, and 0fXXXXXXXX (an fp32's bits)."""
    regs = {k: np.asarray(v, U32) for k, v in operands.items()}

    def val(tok: str):
        if tok in regs:
            return regs[tok]
        return U32(int(tok[2:], 16)) if tok.startswith("0f") else U32(int(tok, 0))

    with np.errstate(over="ignore", invalid="ignore"):
        for line in text.replace("{", "").replace("}", "").split(";"):
            line = line.strip()
            if not line or line.startswith(".reg"):
                continue
            op, args = line.split(None, 1)
            if op not in OPS:
                raise NotImplementedError(op)
            dst, *src = [a.strip() for a in args.split(",")]
            regs[dst] = OPS[op](*[val(a) for a in src])
    return regs
