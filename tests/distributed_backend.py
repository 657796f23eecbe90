"""The process-group backend of the distributed tests: NCCL when two or more GPUs are visible (one per rank, by
LOCAL_RANK), gloo on CPU otherwise. Workers call init() instead of choosing themselves, so the same tests run over
NCCL on a GPU machine and over gloo in the CPU suite."""
import os

import torch
import torch.distributed as dist


def name() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def init() -> str:
    backend = name()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return backend
