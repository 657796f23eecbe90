"""The inline PTX of the packed decode (kernels/nvfp4_gemm.py `_E2M1_X2_PTX`) executed here by the numpy interpreter
of the kernels' PTX subset (ptx_interpreter.py), on every byte in every position of its input register: each output
register must hold the fp16 bits the Triton decode (the interpreter's path, tested bitwise against the reference)
makes from that byte's two codes. The GPU runs the PTX; this proves on the CPU that the two branches of
`_operand_tile` agree."""
import re

import numpy as np
import pytest

from minite.kernels import nvfp4_gemm as ng

from .ptx_interpreter import prmt, run_ptx


def _fp16_bits(code: np.ndarray) -> np.ndarray:
    """What the Triton branch computes per code: ((c & 7) << 9) | ((c & 8) << 12), e2m1 x 2^-14 as fp16 bits."""
    return ((code & 7) << 9) | ((code & 8) << 12)


@pytest.mark.parametrize("position", range(4))
def test_ptx_decode_matches_the_triton_decode_for_every_byte(position):
    text = ng._E2M1_X2_PTX.value if hasattr(ng._E2M1_X2_PTX, "value") else ng._E2M1_X2_PTX
    n_out = len(set(re.findall(r"\$(\d+)", text))) - 1  # the last operand is the input register
    assert n_out == 4, "four bytes in, one register per byte out (pack=4, '=r,=r,=r,=r,r')"
    byte = np.arange(256, dtype=np.uint32)
    others = (0x5A, 0xC3, 0x0F, 0xF0)  # the other bytes of the register must not leak in
    word = np.zeros(256, dtype=np.uint32)
    for i in range(4):
        word |= (byte if i == position else np.uint32(others[i])) << np.uint32(8 * i)
    got = run_ptx(text, {f"${n_out}": word})[f"${position}"]
    want = _fp16_bits(byte & 15) | (_fp16_bits(byte >> 4) << 16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"byte {bad[0]:#04x} at position {position}: {got[bad[0]]:#010x} != {want[bad[0]]:#010x}"


def test_interpreter_prmt_semantics():
    assert prmt(0x44332211, 0x88776655, 0x3210) == 0x44332211
    assert prmt(0x44332211, 0x88776655, 0x7654) == 0x88776655
    assert prmt(0x44332211, 0, 0x4442) == 0x33  # byte 2, zero-extended from the zero register
    assert prmt(0x000000F0, 0, 0x4448) == 0xFF  # sign-replicate mode
