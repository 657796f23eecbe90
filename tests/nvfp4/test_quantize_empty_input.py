"""quantize() on an empty tensor: a clear ValueError where no global scale can be derived; the shapes that have
one (row scope with K > 0, or a given global_amax) keep working, because experts that receive no tokens rely on it."""
import pytest
import torch

from minite.nvfp4 import quantize


@pytest.mark.parametrize("shape,scope", [((0, 16), "tensor"), ((16, 0), "tensor"), ((16, 0), "row")])
def test_empty_input_without_a_global_scale_is_a_clear_error(shape, scope):
    with pytest.raises(ValueError, match=r"empty tensor of shape .*pass global_amax"):
        quantize(torch.empty(*shape), scale_scope=scope)


def test_empty_rows_with_row_scope_still_quantise():
    q = quantize(torch.empty(0, 16), scale_scope="row")
    assert q.shape == (0, 16) and q.data.shape == (0, 8)


def test_empty_input_with_a_given_global_amax_still_quantises():
    q = quantize(torch.empty(0, 16), scale_scope="tensor", global_amax=torch.tensor(1.0))
    assert q.shape == (0, 16)
