"""The files around a conversion: directories named on the command line, JSON inputs, and the output directory.

Every problem is a `ConversionError` naming the path and what is wrong: a user error, which `minite convert` reports
as one line with exit status 2 (minite/cli.py).

Output: `--out` must not exist or be an empty directory (a conversion never mixes its files with other files, and
never replaces a checkpoint). The conversion writes into a staging directory beside it, `.NAME.tmp-PID-XXXXXXXX` on
the same filesystem, and renames that to --out once every file is written: --out appears complete or not at all.
A failure or Ctrl-C removes the staging directory; a process killed outright (SIGKILL) cannot, and leaves it behind,
to be deleted by hand.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from minite.convert.safetensors_stream import ConversionError

_OUT_HINT = "give a new directory, or an empty one"


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
    """`out` as a Path when it may receive a conversion: absent, or an empty directory (module docstring)."""
    out = Path(out)
    if out.is_dir():
        if any(out.iterdir()):
            raise ConversionError(f"--out {out}: directory not empty, refusing to write over it ({_OUT_HINT})")
    elif out.exists() or out.is_symlink():
        raise ConversionError(f"--out {out}: exists and is not a directory ({_OUT_HINT})")
    return out


@contextmanager
def staged_output(out) -> Iterator[Path]:
    """A staging directory beside `out` to write into; renamed to `out` when the block ends without an exception,
    removed when it raises (KeyboardInterrupt included)."""
    out = check_out(out)
    if out.is_symlink():  # an empty directory named through a link: stage beside the directory itself
        out = out.resolve()
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
    except OSError as e:
        raise ConversionError(f"--out {out}: cannot create a directory beside it: {e.strerror or e}") from None
    try:
        yield stage
        check_out(out)  # nothing appeared there while the conversion ran
        try:
            os.replace(stage, out)  # replaces an empty directory; atomic on one filesystem
        except OSError as e:
            raise ConversionError(f"--out {out}: cannot move the converted files into place: {e.strerror or e}"
                                  ) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
