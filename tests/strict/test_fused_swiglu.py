"""minite.strict.fused_swiglu: strict mode's expert SwiGLU fused with FC2's NVFP4 activation quantisation gives the
torch ops' bits (`swiglu(strict=True)`, then the activation recipe's quantiser): under the interpreter on the CPU,
compiled on a GPU (the same tests)."""
import torch

from minite.nvfp4 import NVFP4Recipe
from minite.ops import swiglu
from minite.strict import fused, fused_swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_strict_swiglu_quantisation_is_the_torch_ops(monkeypatch):
    recipe = NVFP4Recipe()
    for rows, f in ((5, 48), (64, 768), (1, 16)):
        g = torch.Generator().manual_seed(rows)
        h = (torch.randn(rows, 2 * f, generator=g) * 6).bfloat16()
        h[0, :4] = torch.tensor([0.0, -0.0, 120.0, -160.0])  # zero, -0, the exp's clamps
        probs = torch.rand(rows, generator=g)
        h, probs = h.to(DEVICE), probs.to(DEVICE)
        flag = torch.zeros((), dtype=torch.float32, device=DEVICE)
        got = fused_swiglu.swiglu_quantize(h, probs, flag=flag)
        with monkeypatch.context() as mp:
            mp.setattr(fused, "PROVEN", fused.PROVEN - {"exp"})  # strict mode's torch ops
            a = swiglu(h, probs, strict=True)
        want = recipe.activation.quantize(a, values=True, backend="triton" if DEVICE == "cpu" else "auto")
        assert got.equal(want) and torch.equal(got.values, want.values), (rows, f)
        assert float(flag) == float(a.float().abs().max())
