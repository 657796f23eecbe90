"""CPU TEST STAND-IN (tests/rollout/sglang/stubs/README.md). transformers reads InterpolationMode's members at import."""
import enum

from torchvision import make_getattr


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = make_getattr(__name__)
