"""GPU tests: marked `gpu` (registered here and in pytest.ini) and skipped by a capability probe that says why."""
import pytest
import torch


def cuda_sm90_reason() -> str | None:
    """None when a CUDA device of compute capability >= 9.0 is present, else why the GPU tests cannot run."""
    if not torch.cuda.is_available():
        return "needs CUDA sm_90 (no CUDA device)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs CUDA sm_90 (found sm_{major}{minor})"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU of compute capability >= 9.0 (capability probe)")


def pytest_collection_modifyitems(config, items):
    reason = cuda_sm90_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
