"""The files around a conversion: directories named on the command line, JSON inputs, and the output directory.

Every problem is a `ConversionError` naming the path and what is wrong: a user error, which `minite convert` reports
as one line with exit status 2 (minite/cli.py).

Output: `--out` must not exist or be an empty directory (a conversion never mixes its files with other files, and
never replaces a checkpoint). The conversion writes into a staging directory and moves its files to --out once every
file is written (`staged_output`): an absent --out appears complete or not at all, an empty one stays empty until
the end. A failure or Ctrl-C removes the staging directory; a process killed outright (SIGKILL) cannot, and leaves a
`.NAME.tmp-HOST-PID-XXXXXXXX` directory beside --out (or `.minite-convert.tmp-...` inside an empty one, which would
make it a non-empty --out). The next conversion into the same --out removes such a directory, naming it, when it was
made on this host and no process holds its lock any more: a conversion holds an exclusive flock on the lock file in
its staging directory until its files are in place, and the kernel releases it when the process dies however it
dies (`remove_stale_stages`). A staging directory of another host (a shared file system), one still locked (a
conversion running, perhaps in another container that shares the host name but not the PID namespace), and one
without its lock file (being created, or moved into place) are left alone.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from minite.convert.safetensors_stream import ConversionError

_OUT_HINT = "give a new directory, or an empty one"
_IN_EMPTY = "minite-convert"  # the staging directory's name inside an existing empty --out
log = logging.getLogger(__name__)


_LOCK = ".minite-convert.lock"  # in a staging directory: flocked by its conversion until its files are in place


def _host() -> str:
    """This host's name as it can stand in a file name (no '-': the staging name's fields are split at them; at most
    32 characters, so that a long --out name still fits a file name)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:32] or "host"


def _lock(path: Path, create: bool = False):
    """An exclusive flock on file `path` (created if absent with `create`; else OSError when absent): the open file,
    or None when another holds it."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_stages(out) -> None:
    """Remove the staging directories that killed conversions into `out` left on this host (module docstring), each
    named in a warning."""
    target, host = Path(os.path.abspath(out)), _host()
    places = [(target.parent, target.name)] + ([(target, _IN_EMPTY)] if target.is_dir() else [])
    for parent, name in places:
        pattern = re.compile(rf"\.{re.escape(name)}\.tmp-(?P<host>[^-/]+)-\d+-[0-9a-f]{{8}}")
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for p in entries:
            m = pattern.fullmatch(p.name)
            if not (m and m["host"] == host and p.is_dir() and not p.is_symlink() and (p / _LOCK).is_file()):
                continue
            try:  # never created here: a lock file that just went is a conversion's moving its files into place
                fd = _lock(p / _LOCK)
            except OSError:
                continue
            if fd is None:  # a conversion holds it: running
                continue
            try:
                shutil.rmtree(p, ignore_errors=True)
            finally:
                os.close(fd)
            if p.exists():
                log.warning("could not remove %s, the staging directory of a killed conversion into %s", p, out)
            else:
                log.warning("removed %s: the staging directory of a conversion into %s that was killed", p, out)


def input_dir(path, option: str) -> Path:
    """`path` as a Path when it is an existing directory; else ConversionError naming `option` (e.g. "--hf")."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{option} {path}: does not exist")
    if not path.is_dir():
        raise ConversionError(f"{option} {path}: not a directory ({option} names a checkpoint's directory)")
    return path


def read_json(path) -> object:
    """The JSON value in file `path`; ConversionError for a missing, unreadable or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: not found")
    try:
        return json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not readable as JSON ({e})") from None


def read_json_object(path) -> dict:
    """As read_json, for a file that must hold a JSON object."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def plain_name(name: object, where: str) -> str:
    """`name` when it is a file name without directories (a name a checkpoint lists); else ConversionError."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ConversionError(f"{where}: {name!r} is not a file name")
    return name


def read_index(path) -> dict:
    """A safetensors index (model.safetensors.index.json): {"weight_map": {tensor: file name}, "metadata": {..}},
    its weight_map non-empty and naming plain files."""
    index = read_json_object(path)
    weight_map, metadata = index.get("weight_map"), index.get("metadata")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{path}: no weight_map (expected {{tensor name: file name}})")
    for name, file in weight_map.items():
        plain_name(file, f"{path}: weight_map[{name!r}]")
    if metadata is not None and not isinstance(metadata, dict):
        raise ConversionError(f"{path}: metadata is a {type(metadata).__name__}, expected a JSON object")
    return index


def check_out(out) -> Path:
    """`out` as a Path when it may receive a conversion: absent, or an empty directory (module docstring), once
    the staging directories of killed conversions into it are removed."""
    out = Path(out)
    remove_stale_stages(out)
    if out.is_dir():
        inside = sorted(p.name for p in out.iterdir())
        if inside:
            what = (f"{inside[0]!r}, the staging directory of a conversion into it that is running or ran on another "
                    "host: delete it if none is" if inside[0].startswith(f".{_IN_EMPTY}.tmp-") else repr(inside[0]))
            raise ConversionError(f"--out {out}: directory not empty ({what}), refusing to write over it "
                                  f"({_OUT_HINT})")
    elif out.exists() or out.is_symlink():
        raise ConversionError(f"--out {out}: exists and is not a directory ({_OUT_HINT})")
    return out


@contextmanager
def staged_output(out) -> Iterator[Path]:
    """A staging directory to write into, its files moved to `out` when the block ends without an exception, removed
    when it raises (KeyboardInterrupt included). Absent, `out` is created by renaming the staging directory beside it
    (atomic); an empty directory (perhaps a mount point, a link or the current directory) stays the directory it is:
    the staging directory is made inside it and its files are renamed into it at the end."""
    shown = check_out(out)
    existing = shown.is_dir()
    target = Path(os.path.abspath(shown))  # normalised: "." or "a/.." has no name to stage beside
    parent = target if existing else target.parent
    name = _IN_EMPTY if existing else target.name
    stage = parent / f".{name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
        lock = _lock(stage / _LOCK, create=True)  # held until the files are in place (module docstring)
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise ConversionError(f"--out {shown}: cannot create a directory there: {e.strerror or e}") from None
    try:
        yield stage
        (stage / _LOCK).unlink()  # not part of the output; the open file keeps the lock until the end
        if existing:
            _move_into(stage, target, shown)
        else:
            try:
                os.replace(stage, target)  # fails if a file or a non-empty directory appeared there meanwhile
            except OSError as e:
                raise ConversionError(f"--out {shown}: cannot move the converted files into place: "
                                      f"{e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _move_into(stage: Path, target: Path, shown: Path) -> None:
    """Rename every file of `stage` into `target` (which must hold nothing else), then remove `stage`; the files
    already moved are removed again if this fails or is interrupted."""
    others = [p.name for p in target.iterdir() if p != stage]
    if others:
        raise ConversionError(f"--out {shown}: {others[0]!r} appeared there while converting ({_OUT_HINT})")
    moved = []
    try:
        for f in sorted(stage.iterdir()):
            os.replace(f, target / f.name)
            moved.append(target / f.name)
        stage.rmdir()
    except BaseException:
        for f in moved:
            f.unlink(missing_ok=True)
        raise
