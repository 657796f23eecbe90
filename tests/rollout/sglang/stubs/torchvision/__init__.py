"""CPU TEST STAND-IN for torchvision (tests/rollout/sglang/stubs/README.md): imports succeed, any use raises."""


class _Inert:
    """Placeholder for any torchvision attribute: constructing or calling it raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a CPU test stand-in here (tests/rollout/sglang/stubs); it cannot be used")

    def __class_getitem__(cls, item):
        return cls


def make_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Inert,), {"__module__": module_name})
    return __getattr__


__version__ = "0.0.0+stub"
__getattr__ = make_getattr(__name__)
