"""NVFP4Recipe: how each GEMM operand of a linear layer is quantised, and which modules stay BF16.

A linear layer y = x W^T runs three GEMMs, each with two NVFP4 operands:
    fprop  y  = x  @ W^T      operands: activation x (rows = tokens), weight W
    dgrad  dx = dy @ W        operands: gradient dy, weight W^T (the 16x16 transpose of the same quantised W)
    wgrad  dW = dy^T @ x      operands: dy^T and x^T, quantised along the token dim (K of this GEMM)
Defaults follow Transformer Engine's NVFP4BlockScaling roles with one change, per-row activation scales:
- weights: 16x16 blocks, one global scale, so W and W^T quantise to the same values (fprop and dgrad share it);
- activations: 1x16 blocks with one global scale per row (token), which keeps a token's quantisation independent of
  the batch around it (docs/nvfp4.md, "Roles": the only way rollout and training can agree bitwise);
- gradients: stochastic rounding (unbiased in expectation), one global scale;
- wgrad operands: the 16-point random Hadamard transform along K before quantisation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .quantize import quantize
from .tensor import BLOCK_1D, BLOCK_2D, NVFP4Tensor


@dataclass(kw_only=True)
class OperandRecipe:
    """How one GEMM operand is quantised."""

    block: tuple[int, int] = BLOCK_1D
    """(1, 16) or (16, 16) elements per E4M3 block scale."""
    scale_scope: str = "row"
    """"row": one FP32 global scale per row; "tensor": one for the whole operand."""
    rounding: str = "nearest"
    """"nearest" (round to nearest even) or "stochastic"."""
    rht: bool = False
    """Apply the 16-point random Hadamard transform along K before quantising."""

    def __post_init__(self):
        self.block = tuple(self.block)
        if self.block not in (BLOCK_1D, BLOCK_2D):
            raise ValueError(f"block must be (1, 16) or (16, 16), got {self.block}")
        if self.scale_scope not in ("row", "tensor"):
            raise ValueError(f"scale_scope must be 'row' or 'tensor', got {self.scale_scope!r}")
        if self.scale_scope == "row" and self.block == BLOCK_2D:
            raise ValueError("scale_scope='row' needs (1, 16) blocks")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")

    def quantize(self, x, *, seed: int | None = None, backend: str = "auto", values: bool = False,
                 check_finite: bool = True, global_amax=None, finite_flag=None) -> NVFP4Tensor:
        return quantize(x, block=self.block, scale_scope=self.scale_scope, rounding=self.rounding,
                        seed=seed, rht=self.rht, backend=backend, values=values, check_finite=check_finite,
                        global_amax=global_amax, finite_flag=finite_flag)


def _weight() -> OperandRecipe:
    return OperandRecipe(block=BLOCK_2D, scale_scope="tensor")


def _activation() -> OperandRecipe:
    return OperandRecipe(block=BLOCK_1D, scale_scope="row")


def _gradient() -> OperandRecipe:
    return OperandRecipe(block=BLOCK_1D, scale_scope="tensor", rounding="stochastic")


def _wgrad_input() -> OperandRecipe:
    return OperandRecipe(block=BLOCK_1D, scale_scope="tensor", rht=True)


def _wgrad_gradient() -> OperandRecipe:
    return OperandRecipe(block=BLOCK_1D, scale_scope="tensor", rounding="stochastic", rht=True)


@dataclass(kw_only=True)
class NVFP4Recipe:
    """Per operand role, the quantisation; and which modules keep BF16."""

    weight: OperandRecipe = field(default_factory=_weight)
    """Weights (fprop and, transposed, dgrad)."""
    activation: OperandRecipe = field(default_factory=_activation)
    """Forward activations (fprop's x)."""
    gradient: OperandRecipe = field(default_factory=_gradient)
    """Output gradients in dgrad (dy along the layer's output features)."""
    wgrad_input: OperandRecipe = field(default_factory=_wgrad_input)
    """x^T in wgrad, along the token dim."""
    wgrad_gradient: OperandRecipe = field(default_factory=_wgrad_gradient)
    """dy^T in wgrad, along the token dim."""
    bf16_modules: tuple[str, ...] = ("embedding", "router", "output_layer")
    """Module roles that stay BF16 (attention math is always high precision)."""
    bf16_first_layers: int = 0
    """How many leading transformer layers stay BF16."""
    bf16_last_layers: int = 0
    """How many trailing transformer layers stay BF16."""

    def __post_init__(self):
        self.bf16_modules = tuple(self.bf16_modules)
        known = {"embedding", "router", "output_layer", "attention_linears", "mlp", "experts"}
        unknown = set(self.bf16_modules) - known
        if unknown:
            raise ValueError(f"bf16_modules: unknown roles {sorted(unknown)}; known: {sorted(known)}")
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")
        if self.weight.block != BLOCK_2D or self.weight.scale_scope != "tensor":
            raise ValueError("weight must use (16, 16) blocks and one global scale: dgrad reuses W^T unquantised")
