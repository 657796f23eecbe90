"""Checkpoints of the RL loop: atomic saves and a resume that continues bit for bit.

Layout under checkpoint.dir:
    step_000010/state.pt      one complete checkpoint (after 10 RL steps)
    step_000020/state.pt
    .tmp-step_000030-<pid>/   a save in progress (or one killed mid-save: ignored, removed by the next save)

Atomicity: a save writes state.pt into a fresh temporary directory, flushes it to disk (fsync of the
file and the directory), then renames the directory to step_NNNNNN. A rename within one file system
is atomic (POSIX rename(2)), so a step_* directory either does not exist or holds a complete file: a
kill at any moment leaves the previous checkpoint as the newest complete one. `latest_checkpoint`
therefore just takes the highest step_* directory; there is no pointer file that could go stale.

What is saved, everything the next step reads:
    learner     model + optimizer (Learner.state_dict)
    ref         the frozen reference policy's weights (when the KL penalty uses one)
    rng         torch CPU (and CUDA) generators, Python's and NumPy's, Megatron's RNG tracker
    data        the prompt stream's position (tasks.PromptStream)
    step        RL steps completed
Rollout sampling is seeded from (rl.seed, step) and the engine never touches the global RNG, so
with these the resumed run draws the same prompts, samples the same tokens and takes the same
optimizer steps as an uninterrupted run (tests/unit/test_checkpoint.py checks it bitwise).

Errors: a missing or unreadable state.pt raises CheckpointError naming the file.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "minite-rl-checkpoint/1"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
STATE_FILE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not belong to this run; the message names the file."""


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        rng["megatron_tracker"] = tracker.get_states()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(_as_tuple(rng["python"]))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    tracker = _megatron_rng_tracker()
    if tracker is not None and rng.get("megatron_tracker"):
        tracker.set_states(rng["megatron_tracker"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _megatron_rng_tracker():
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if getattr(tracker, "states_", None) else None


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Atomically write `state` (plus format and step) as root/step_NNNNNN; keep the newest `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    path = tmp / STATE_FILE
    with open(path, "wb") as f:
        torch.save({"format": FORMAT, "step": step, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one out of the way first
        old = root / f".tmp-old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temps(root: Path) -> None:
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, p in _complete_steps(root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory under root, or None if there is none."""
    steps = _complete_steps(Path(root))
    return steps[-1][1] if steps else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint directory (or its state.pt). Raises CheckpointError naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (expected a step_NNNNNN directory or its {STATE_FILE})")
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"checkpoint file not found: {file}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/garbled files
        raise CheckpointError(f"checkpoint file {file} is corrupt or unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {file} is not a {FORMAT} checkpoint")
    missing = [k for k in ("step", "learner", "rng", "data") if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {file} lacks {missing}")
    return state
