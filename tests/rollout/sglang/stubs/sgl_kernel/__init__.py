"""CPU TEST STAND-IN for sgl_kernel (tests/rollout/sglang/stubs/README.md).

SGLang's CPU engine imports a few sgl_kernel functions at module level (e.g. copy_all_layer_kv_cache_cpu for KV-cache
moves); the offline engine path we test never calls them. Any attribute is a function that raises when called, so a
call we did not expect fails loudly instead of computing something wrong. No `torch.ops.sgl_kernel` ops are
registered, so SGLang's AMX probe (cpu_has_amx_support) stays False.
"""

__version__ = "0.0.0+stub"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _inert(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called, but sgl_kernel is a CPU test stand-in (tests/rollout/sglang/stubs)")

    _inert.__name__ = name
    return _inert
