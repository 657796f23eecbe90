"""Failures a user fixes in the config, as the RL loop reports them: one line for `minite train` (USER_ERRORS in
minite.cli: exit status 2) naming where the run stopped and what to change, in place of an "unexpected" torch error.

    with stop_cleanly(cfg, "at RL step 3 of 50"):
        rl_step(run)

NaN or Inf anywhere a step checks (minite.nvfp4.NonFiniteError: a quantiser's input, the NVFP4 finite flag, the
logits, the weights handed to the engine, the metrics) -> DivergedError; an allocation that failed (torch's CPU
allocator or CUDA out of memory) -> OutOfMemoryRunError. Anything else passes through unchanged.
"""
from __future__ import annotations

import contextlib
import re

import torch

from minite.console import one_line
from minite.nvfp4 import NonFiniteError
from minite.rl import checkpoint as ckpt


class DivergedError(RuntimeError):
    """NaN or Inf met during a step (a NonFiniteError: in a quantiser's input, the logits, the weights handed to the
    engine or the step's metrics): the run diverged. One line for `minite train` (a user error, exit status 2)."""


class OutOfMemoryRunError(RuntimeError):
    """An allocation failed (torch's CPU allocator or CUDA out of memory) while building the run or in a step: the
    model or a step's rows do not fit the device. One line for `minite train` (a user error, exit status 2)."""


MODEL_TOO_BIG = "the model does not fit: shrink it (model.*) or spread it over more ranks (parallel.ep, parallel.tp)"
ROWS_TOO_MANY = ("a step's rows do not fit: lower rl.prompts_per_step or rollout.group_size, or raise "
                 "rl.micro_batches")
CHECKPOINT_TOO_BIG = ("taking the checkpoint (a copy of the model and optimizer state in host memory, ~14 bytes per "
                      "parameter) needs more memory than is free: free some, or save no checkpoints "
                      "(--set checkpoint.dir=null)")


@contextlib.contextmanager
def stop_cleanly(cfg, where: str, memory_fix: str = ROWS_TOO_MANY):
    """Two failures the user fixes in the config end the run with one line naming `where` and what to change:
    - NaN or Inf (NonFiniteError) -> DivergedError: a lower learning rate, then the same command, which resumes from
      the newest checkpoint. None is written from a step whose weights or metrics are not finite (their checks come
      first), but the newest may hold weights already on their way there: the message names the older ones' way too.
    - a failed allocation -> OutOfMemoryRunError with `memory_fix`."""
    try:
        yield
    except NonFiniteError as e:
        newest = ckpt.latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        again = (f"it resumes from the newest checkpoint, {newest} (an older one: --set checkpoint.resume_from=DIR "
                 "--set checkpoint.dir=ANOTHER_DIR --set logging.dir=ANOTHER_DIR; start over: --fresh)"
                 if newest is not None and cfg.checkpoint.resume else "it starts over")
        raise DivergedError(f"the run diverged {where}: {one_line(e)}. Lower optim.lr (optim.lr={cfg.optim.lr:g}, "
                            f"optim.clip_grad={cfg.optim.clip_grad:g}) and run the same command again: {again}") from e
    except RuntimeError as e:
        failed = failed_allocation(e)
        if failed is None:
            raise
        raise OutOfMemoryRunError(f"out of memory {where} ({failed}): {memory_fix}") from e


def failed_allocation(e: BaseException) -> str | None:
    """What a failed allocation asked for ("an allocation of 64.0 GiB on the CPU"), or None if `e` is not one:
    torch.OutOfMemoryError (CUDA), or the RuntimeError of torch's CPU allocator ("DefaultCPUAllocator: can't allocate
    memory: you tried to allocate N bytes")."""
    text = str(e)
    if isinstance(e, torch.OutOfMemoryError):
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
        return f"an allocation of {asked[1]} on the GPU" if asked else "CUDA out of memory"
    if "can't allocate memory" in text:
        asked = re.search(r"tried to allocate (\d+) bytes", text)
        return f"an allocation of {int(asked[1]) / 2**30:.1f} GiB on the CPU" if asked else "the CPU allocator failed"
    return None
