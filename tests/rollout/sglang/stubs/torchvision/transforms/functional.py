"""CPU TEST STAND-IN (tests/rollout/sglang/stubs/README.md)."""
from torchvision import make_getattr
from torchvision.transforms import InterpolationMode  # noqa: F401

__getattr__ = make_getattr(__name__)
