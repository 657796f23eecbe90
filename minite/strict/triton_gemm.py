"""Strict-mode BF16 GEMM on CUDA: one Triton kernel, one tile configuration, K reduced in a fixed order.

y[m, n] = sum over K blocks k0 = 0, 64, 128, ... (in that order) of tl.dot(x[m, k0:k0+64], w[n, k0:k0+64]) in fp32.
The configuration is a constant (no autotuning, no split-K, no atomics), so every output element is produced by the
same instruction sequence whatever M is: the program that holds row m differs between a decode step (M = batch)
and a full forward (M = B*T), the arithmetic does not. docs/nvfp4.md records exactly this, measured on the H200
(a sequential-K Triton bf16 matmul gave bitwise identical rows for M = 1, 7, 512 and for every tile shape tried);
tests/alignment/test_strict_alignment_gpu.py checks it for this kernel at M = 1..512.

Why not the CPU strict GEMM on the GPU: `strict_ops.linear` materialises [M, N, K] products; at decode sizes it
was 4.8x slower than cuBLAS per step on the H200 (docs/alignment.md), while a fixed-order tensor-core kernel costs
about what a GEMM costs. The guarantee differs in kind: strict_ops is batch invariant by IEEE-754 rules alone; this
kernel by a fixed instruction sequence (deterministic hardware), verified bitwise on the device.
Inputs must be bf16 or fp16 (fp32 operands would go through TF32 or a slow IEEE path; strict mode keeps fp32
GEMMs, e.g. the router's, on strict_ops).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep CPU imports cheap and safe
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 64, 4

if triton is not None:
    @triton.jit
    def _fixed_k_matmul(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the fixed-K Triton GEMM applies: CUDA tensors, bf16/fp16 operands of one dtype, 2-D."""
    return (triton is not None and x.is_cuda and w.is_cuda and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and w.dim() == 2)


def matmul_fixed_k(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [N, K]^T -> fp32 [M, N] with the fixed configuration above (see the module docstring)."""
    if not available(x, w):
        raise ValueError("matmul_fixed_k needs 2-D CUDA bf16/fp16 operands of one dtype")
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fixed_k_matmul[grid](x, w, y, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                          y.stride(0), y.stride(1), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS)
    return y
