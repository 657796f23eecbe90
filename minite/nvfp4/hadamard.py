"""The 16-point random Hadamard transform (RHT) applied to wgrad GEMM operands along K.

M = diag(signs) @ H16 / 4, with H16 the Sylvester Hadamard matrix and one fixed sign vector (Transformer Engine's,
identical on every rank, so every rank transforms the same way and our results stay comparable with TE).
M is orthogonal (M M^T = diag(s) H H^T diag(s) / 16 = I), so (A M)(B M)^T = A B^T for two operands transformed
along the same K: the transform spreads outliers across a block before 4-bit quantisation without changing the GEMM.

Arithmetic (docs/nvfp4.md, "RHT"): y_j = fl32(fl32(((s_0j x_0 + s_1j x_1) + ...) + s_15j x_15) * 1/4), with
s_ij = sign_i * H_ij = +-1: the signed inputs are summed left to right in fp32, then scaled by 1/4 once. A product by
+-1 is a sign flip, exact for every input including fp32 subnormals (x * 1/4 is not: it drops the low bits of a
subnormal), and no fma contraction can change a sum of sign-flipped inputs, so the reference, the interpreter and the
compiled kernels compute the same bits. In the normal range this equals the sum of the exact products x_i * m_ij in
the same order (scaling by a power of two commutes with round-to-nearest), so it is the value Transformer Engine's
transform gives whenever that fp32 sum is exact (TE's matmul order is unspecified; a 16-term sum of bf16 inputs is
exact unless one group spans more than ~2^12 in magnitude). For subnormal inputs the result is the exact transform
rounded once (TE's fp32 reference rounds each subnormal product x * 1/4 first and can differ by an ulp there).
A group whose signed partial sums exceed FLT_MAX (inputs above ~2^124) overflows to inf.

Then, as Transformer Engine does before the amax and the quantisation, the transformed values are rounded to the
input dtype when it is bf16 or fp16 (round to nearest even) and continue in fp32; fp32 inputs stay fp32.
"""
from __future__ import annotations

import torch

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sylvester_hadamard(n: int = 16) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix of +-1 (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(device=None) -> torch.Tensor:
    """diag(signs) @ H16 / 4 in fp32 (entries exactly +-0.25)."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    return (signs[:, None] * sylvester_hadamard(16) / 4).to(device)


def rht_sign_matrix(device=None) -> torch.Tensor:
    """diag(signs) @ H16 in fp32 (entries +-1): rht_matrix() * 4."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    return (signs[:, None] * sylvester_hadamard(16)).to(device)


def apply_rht(x: torch.Tensor) -> torch.Tensor:
    """Transform each 16-element group of the last dim of a 2-D tensor: x_group @ M in the fixed order of the module
    docstring; returns fp32 values, rounded to x's dtype first when x is bf16 or fp16."""
    rows, cols = x.shape
    if cols % 16:
        raise ValueError(f"RHT needs the last dim to be a multiple of 16, got {cols}")
    groups = x.float().reshape(rows, cols // 16, 16)
    s = rht_sign_matrix(x.device)
    acc = groups[..., 0:1] * s[0]
    for i in range(1, 16):
        acc = acc + groups[..., i:i + 1] * s[i]
    y = (acc * 0.25).reshape(rows, cols)
    if x.dtype in (torch.bfloat16, torch.float16):
        y = y.to(x.dtype).float()
    return y
