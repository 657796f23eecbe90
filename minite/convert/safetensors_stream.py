"""Streaming safetensors I/O: read any row range of a tensor, write a file tensor by tensor, without mmap.

Why not the `safetensors` package: its readers mmap the whole file, and every page a conversion touches then
counts in the process's resident set until the file is closed (a 4-5 GB shard of Qwen3-30B-A3B would sit in RSS).
Here a read is `seek + readinto` of exactly the bytes asked for, and a write appends bytes to a header that was
written first, so a conversion holds at most one chunk of one tensor (see `hf_megatron.CHUNK_BYTES`).

The format (https://github.com/huggingface/safetensors, "Format"):
    8 bytes   N, little-endian u64: the header's length
    N bytes   JSON {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
              padded with spaces to a multiple of 8 (what the reference writer does)
    rest      the tensors' bytes, row-major, little-endian; offsets are relative to the end of the header and
              must tile the data region without holes or overlaps.
Files written here are read by `safetensors.safe_open` and by transformers (tests/convert/test_convert.py checks).

Every error is a `ConversionError` naming the file and, where one is involved, the tensor.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from minite.ops import first_nonfinite

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the reference reader's limit


def view2d(shape: Sequence[int]) -> Tuple[int, int]:
    """The 2-D view every conversion piece addresses: all but the last dim are rows ([E, N, K] -> [E*N, K])."""
    if not shape:
        return 1, 1
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, shape[-1]


class ConversionError(ValueError):
    """A checkpoint is incomplete, inconsistent or unreadable; the message names the tensor and the file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: absolute byte offsets [begin, end) in `file`."""

    name: str
    file: Path
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def rows(self) -> int:
        """Rows of the 2-D view [prod(shape[:-1]), shape[-1]] that reads and pieces use (1-D: one row)."""
        return view2d(self.shape)[0]

    @property
    def row_elems(self) -> int:
        return view2d(self.shape)[1]

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=DTYPES[self.dtype]).element_size()


def _check_entry(path: Path, name: str, info: object) -> Tuple[int, int, Tuple[int, ...]]:
    """(begin, end, shape) of one header entry, each field checked: a dtype of DTYPES, sizes and offsets >= 0."""
    if not isinstance(info, dict):
        raise ConversionError(f"{path}: tensor {name!r}: header entry {info!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ConversionError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise ConversionError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    return offsets[0], offsets[1], tuple(shape)


def read_header(path: Path) -> Dict[str, TensorEntry]:
    """Parse and check a safetensors header; a file shorter than its header says is reported as truncated."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated file ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ConversionError(f"{path}: truncated file or not safetensors (header of {n} bytes, file {size})")
        try:
            meta = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: unreadable safetensors header: {e}") from None
    if not isinstance(meta, dict):
        raise ConversionError(f"{path}: unreadable safetensors header: a JSON {type(meta).__name__}, not an object")
    base = 8 + n
    entries: Dict[str, TensorEntry] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        b, e, shape = _check_entry(path, name, info)
        entry = TensorEntry(name, path, info["dtype"], shape, base + b, base + e)
        numel = entry.rows * entry.row_elems
        if e - b != numel * entry.itemsize:
            raise ConversionError(f"{path}: tensor {name!r}: {e - b} bytes for shape {list(entry.shape)} "
                                  f"{entry.dtype}")
        if entry.end > size:
            raise ConversionError(f"{path}: truncated file: tensor {name!r} needs bytes up to {entry.end}, "
                                  f"the file has {size}")
        entries[name] = entry
    return entries


class RowReader:
    """Reads row ranges of tensors (the tensor viewed as [rows, prod(shape[1:])]); keeps files open."""

    def __init__(self):
        self._files: Dict[Path, object] = {}

    def rows(self, entry: TensorEntry, r0: int, r1: int) -> torch.Tensor:
        out = torch.empty(r1 - r0, entry.row_elems, dtype=DTYPES[entry.dtype])
        f = self._files.get(entry.file)
        if f is None:
            f = self._files[entry.file] = open(entry.file, "rb")
        row_bytes = entry.row_elems * entry.itemsize
        f.seek(entry.begin + r0 * row_bytes)
        buf = out.view(torch.uint8).reshape(-1).numpy() if out.numel() else memoryview(b"")
        got = f.readinto(buf) if out.numel() else 0
        if got != (r1 - r0) * row_bytes:
            raise ConversionError(f"{entry.file}: truncated file while reading tensor {entry.name!r}")
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def refuse_nonfinite(t: torch.Tensor, name: str, where, target: str = "") -> None:
    """ConversionError naming tensor `name` and `where` it was read from (its file, or a checkpoint directory) when
    floating t holds NaN or Inf (read for `target`, when another tensor): weights no run can start from (they would
    surface as a diverged first step)."""
    if t.is_floating_point() and first_nonfinite({name: t}) is not None:
        into = f", read for {target!r}" if target and target != name else ""
        raise ConversionError(f"tensor {name!r} in {where} holds NaN or Inf{into}: not weights a run can start from; "
                              "nothing was written")


class StreamWriter:
    """Writes one safetensors file: the header from `specs` first, then each tensor's bytes in `specs` order.

    specs: [(name, dtype name, shape)]. Call `write(name, chunk)` with consecutive row chunks of each tensor (in
    order); `close()` checks that every byte was written and renames the temporary file into place (atomic).
    """

    def __init__(self, path: Path, specs: Sequence[Tuple[str, str, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None):
        self.path = Path(path)
        header: Dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._order: List[Tuple[str, int]] = []
        for name, dtype, shape in specs:
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty(0, dtype=DTYPES[dtype]).element_size()
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._index, self._left = 0, self._order[0][1] if self._order else 0

    def write(self, name: str, chunk: torch.Tensor) -> None:
        expected, _ = self._order[self._index]
        if name != expected:
            raise ConversionError(f"{self.path}: internal error: wrote {name!r} while {expected!r} is due")
        data = chunk.contiguous().view(torch.uint8).reshape(-1).numpy()
        if data.nbytes > self._left:
            raise ConversionError(f"{self.path}: internal error: tensor {name!r} got more bytes than its shape")
        self._f.write(memoryview(data))
        self._left -= data.nbytes
        while self._left == 0 and self._index < len(self._order) - 1:
            self._index += 1
            self._left = self._order[self._index][1]

    def close(self) -> None:
        if self._left or self._index < len(self._order) - 1:
            raise ConversionError(f"{self.path}: internal error: tensor {self._order[self._index][0]!r} incomplete")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)
