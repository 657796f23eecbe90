"""CPU TEST STAND-IN (tests/rollout/sglang/stubs/README.md)."""
from torchvision import make_getattr

__getattr__ = make_getattr(__name__)
