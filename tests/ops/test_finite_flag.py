"""FiniteFlag across inference mode: a generate (torch.inference_mode) may make the flag, a weight update or a train
step records into it afterwards outside inference mode. On the H200 the first version made an inference tensor there
and the next in-place update failed ("Inplace update to inference tensor outside InferenceMode"), which broke every
NVFP4 rollout benchmark row."""
import pytest
import torch

from minite.ops.common import FiniteFlag


def test_flag_made_under_inference_mode_records_outside_it():
    flag = FiniteFlag()
    with torch.inference_mode():
        flag.record(torch.ones(4))
    flag.record(torch.full((2,), 3.0))  # raised before the flag was made outside inference mode
    flag.check("a step")  # all finite: no error
    with torch.inference_mode():
        flag.record(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="NaN or Inf reached an NVFP4 quantiser during a generate"):
        flag.check("a generate")
    flag.check("the next step")  # check resets the flag
