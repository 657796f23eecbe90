"""The 16-point random Hadamard transform (RHT) applied to wgrad GEMM operands along K.

M = diag(signs) @ H16 / 4, with H16 the Sylvester Hadamard matrix and one fixed sign vector (Transformer Engine's,
identical on every rank, so every rank transforms the same way and our results stay comparable with TE).
M is orthogonal (M M^T = diag(s) H H^T diag(s) / 16 = I), so (A M)(B M)^T = A B^T for two operands transformed
along the same K: the transform spreads outliers across a block before 4-bit quantisation without changing the GEMM.

Summation order is part of the definition: y_j = (((x_0 m_0j) + x_1 m_1j) + ...) + x_15 m_15j, left to right in
fp32. Every product is exact (m_ij = +-1/4), so this fixed order is the only choice, and a kernel that follows it
reproduces the reference bit for bit.
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


def apply_rht(x: torch.Tensor) -> torch.Tensor:
    """Transform each 16-element group of the last dim of a 2-D tensor: x_group @ M, in the fixed fp32 order."""
    rows, cols = x.shape
    if cols % 16:
        raise ValueError(f"RHT needs the last dim to be a multiple of 16, got {cols}")
    groups = x.float().reshape(rows, cols // 16, 16)
    m = rht_matrix(x.device)
    acc = groups[..., 0:1] * m[0]
    for i in range(1, 16):
        acc = acc + groups[..., i:i + 1] * m[i]
    return acc.reshape(rows, cols)
