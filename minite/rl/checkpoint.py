"""Checkpoints of the RL loop: atomic, checksummed, one shard per rank, and a resume that continues bit for bit.

Layout under checkpoint.dir:
    step_000010/manifest.json       format, step, world size, layout (tp/ep/pp) and a sha256 + size per shard
    step_000010/state.pt            rank 0's shard (the whole checkpoint when the run has one process)
    step_000010/state.rank00001.pt  rank 1's shard, ... (one per rank: its model/optimizer shard, its RNG)
    .tmp-step_000030/               a save in progress (or one killed mid-save: ignored, removed by the next save)

Every rank holds only its own TP/EP shard of the model and optimizer, so each writes its own file and the set
of files is the whole model; a resume needs the same world size and layout (checked against the manifest).

Atomicity, with every rank agreeing: rank 0 clears stale temporaries and makes the temporary directory, then a
barrier; each rank writes and fsyncs its shard and hashes it; the hashes are gathered to rank 0, which writes the
manifest, fsyncs it and renames the directory to step_NNNNNN; a final barrier. A rename within one file system is
atomic (POSIX rename(2)), so a step_* directory either does not exist or holds every shard and the manifest; only
rank 0 ever deletes a directory, and only while the other ranks wait at a barrier.

Corruption: loading checks the manifest and the sha256 of the rank's own shard; the loop's resume asks every rank
(`agree`) and, when the newest checkpoint is corrupt, names it and falls back to the newest intact one (a
checkpoint the user named with checkpoint.resume_from is never replaced by another: it is an error).

What is saved, everything the next step reads:
    learner     model + optimizer (Learner.state_dict; this rank's shard)
    ref         the frozen reference policy's weights (when the KL penalty uses one)
    rng         torch CPU and CUDA generators, Python's and NumPy's, Megatron's RNG tracker (this rank's)
    data        the prompt stream's position (tasks.PromptStream)
    step        RL steps completed
Rollout sampling is seeded from (rl.seed, step) and the engine never touches the global RNG, so
with these the resumed run draws the same prompts, samples the same tokens and takes the same
optimizer steps as an uninterrupted run (tests/rl/test_checkpoint.py checks it bitwise).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "minite-rl-checkpoint/2"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
TEMP_PREFIX = ".tmp-"


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


def shard_name(rank: int) -> str:
    """Rank 0's shard keeps the single-process name, so a one-process checkpoint is one state.pt."""
    return STATE_FILE if rank == 0 else f"state.rank{rank:05d}.pt"


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()


def _gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (all_gather_object works over gloo and NCCL)."""
    world = rank_and_world()[1]
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], *, keep: int = 2,
                    layout: dict[str, int] | None = None) -> Path:
    """Atomically write every rank's `state` (plus format and step) as root/step_NNNNNN with a manifest; keep the
    newest `keep`. Collective when torch.distributed is initialised: every rank calls it with its own state."""
    root, (rank, world) = Path(root), rank_and_world()
    final = step_dir(root, step)
    tmp = root / f"{TEMP_PREFIX}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root)
        tmp.mkdir()
    _barrier()
    path = tmp / shard_name(rank)
    with open(path, "wb") as f:
        torch.save({"format": FORMAT, "step": step, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    shards = _gather({"file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size})
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world, "layout": layout or {}, "shards": shards}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one out of the way first
            old = root / f"{TEMP_PREFIX}old-{final.name}"
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    _barrier()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temps(root: Path) -> None:
    for p in root.glob(f"{TEMP_PREFIX}*"):
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


def step_of(path: str | Path) -> int:
    """The step in a step_NNNNNN directory's name."""
    m = STEP_DIR.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"not a checkpoint directory name: {path} (expected step_NNNNNN)")
    return int(m.group(1))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint directory under root (complete by construction; not yet verified), or None."""
    steps = _complete_steps(Path(root))
    return steps[-1][1] if steps else None


def checkpoints_newest_first(root: str | Path) -> list[Path]:
    return [p for _, p in reversed(_complete_steps(Path(root)))]


def _checkpoint_dir(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (expected a step_NNNNNN directory or its {STATE_FILE})")
    return path if path.is_dir() else path.parent


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory (or of the directory of one of its shards); CheckpointError names it."""
    d = _checkpoint_dir(Path(path))
    file = d / MANIFEST
    if not file.is_file():
        shard = d / STATE_FILE
        if not shard.is_file():
            raise CheckpointError(f"checkpoint file not found: {shard}")
        raise CheckpointError(f"checkpoint {d} has no {MANIFEST}: it is incomplete or not a {FORMAT} checkpoint")
    try:
        manifest = json.loads(file.read_text())
        shards = {s["file"]: s for s in manifest["shards"]}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {file} is corrupt ({type(e).__name__}: {e})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {d} is not a {FORMAT} checkpoint (manifest format "
                              f"{manifest.get('format')!r})")
    if type(manifest.get("step")) is not int:
        raise CheckpointError(f"checkpoint file {file} is corrupt (no step)")
    manifest["by_file"] = shards
    return manifest


def check_layout(path: str | Path, manifest: dict[str, Any], world: int, layout: dict[str, int] | None) -> None:
    """CheckpointError unless the checkpoint was saved by `world` ranks in `layout` (a resume needs the same)."""
    saved = (manifest.get("world_size"), manifest.get("layout") or {})
    if saved[0] != world or (layout is not None and saved[1] and saved[1] != layout):
        raise CheckpointError(f"checkpoint {path} was saved by {saved[0]} ranks with layout {saved[1]}, this run has "
                              f"{world} ranks with {layout}: resume with the same world size and parallel layout")


def verify_shard(path: str | Path, rank: int = 0) -> Path:
    """The path of `rank`'s shard after checking its size and sha256 against the manifest (CheckpointError)."""
    manifest = read_manifest(path)
    d = _checkpoint_dir(Path(path))
    file = d / shard_name(rank)
    entry = manifest["by_file"].get(file.name)
    if entry is None or not file.is_file():
        raise CheckpointError(f"checkpoint file not found: {file}")
    if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {file} is corrupt (its sha256 differs from {d / MANIFEST})")
    return file


def load_checkpoint(path: str | Path, *, rank: int = 0) -> dict[str, Any]:
    """Load `rank`'s shard of a checkpoint directory (or of the directory of its state.pt), verified against the
    manifest. Raises CheckpointError naming the file."""
    file = verify_shard(path, rank)
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


def agree_load(path: str | Path) -> dict[str, Any]:
    """Collective load: every rank verifies and loads its own shard; if any rank fails, every rank raises the
    first failing rank's CheckpointError (so no rank resumes from a checkpoint another rank rejected)."""
    state, error = None, None
    try:
        state = load_checkpoint(path, rank=rank_and_world()[0])
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in _gather(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return state
