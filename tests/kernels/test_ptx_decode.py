"""The inline PTX of the packed decode (kernels/nvfp4_gemm.py `_E2M1_X2_PTX`) executed here by a small interpreter of
the instructions it uses, on every byte in every position of its input register: each output register must hold the
fp16 bits the Triton decode (the interpreter's path, tested bitwise against the reference) makes from that byte's
two codes. The GPU runs the PTX; this proves on the CPU that the two branches of `_operand_tile` agree."""
import re

import pytest

from minite.kernels import nvfp4_gemm as ng

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> 4 * i) & 0xF
        byte = src[n & 7]
        if n & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def run_ptx(text: str, operands: dict) -> dict:
    """Execute `text` (prmt.b32, mul.lo.u32, and.b32, or.b32, shl.b32; registers $N or named) on 32-bit ints."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & MASK if re.fullmatch(r"(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        if op == "prmt.b32":
            regs[d] = _prmt(*x)
        elif op == "mul.lo.u32":
            regs[d] = (x[0] * x[1]) & MASK
        elif op == "and.b32":
            regs[d] = x[0] & x[1]
        elif op == "or.b32":
            regs[d] = x[0] | x[1]
        elif op == "shl.b32":
            regs[d] = (x[0] << x[1]) & MASK
        else:
            raise NotImplementedError(op)
    return regs


def _fp16_bits(code: int) -> int:
    """What the Triton branch computes per code: ((c & 7) << 9) | ((c & 8) << 12), e2m1 x 2^-14 as fp16 bits."""
    return ((code & 7) << 9) | ((code & 8) << 12)


@pytest.mark.parametrize("position", range(4))
def test_ptx_decode_matches_the_triton_decode_for_every_byte(position):
    text = ng._E2M1_X2_PTX.value if hasattr(ng._E2M1_X2_PTX, "value") else ng._E2M1_X2_PTX
    n_out = len(set(re.findall(r"\$(\d+)", text))) - 1  # the last operand is the input register
    assert n_out == 4, "four bytes in, one register per byte out (pack=4, '=r,=r,=r,=r,r')"
    for byte in range(256):
        others = (0x5A, 0xC3, 0x0F, 0xF0)  # the other bytes of the register must not leak in
        word = 0
        for i in range(4):
            word |= (byte if i == position else others[i]) << 8 * i
        regs = run_ptx(text, {f"${n_out}": word})
        got = regs[f"${position}"]
        want = _fp16_bits(byte & 15) | (_fp16_bits(byte >> 4) << 16)
        assert got == want, f"byte {byte:#04x} at position {position}: {got:#010x} != {want:#010x}"


def test_interpreter_prmt_semantics():
    assert _prmt(0x44332211, 0x88776655, 0x3210) == 0x44332211
    assert _prmt(0x44332211, 0, 0x4442) == 0x33  # byte 2, zero-extended from the zero register
    assert _prmt(0x000000F0, 0, 0x4448) == 0xFF  # sign-replicate mode
