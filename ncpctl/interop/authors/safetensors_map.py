"""Safetensors files mapped into memory, not copied (issue 43 item 5).

``safetensors.torch.load_file`` reads every tensor into fresh memory: loading an 8B model that way
needs the file's size in page cache plus as much again in tensors. Here each file is mapped once
(``mmap``, copy-on-write: the tensors are writable, and a page is copied only if written) and each
tensor is a ``torch.frombuffer`` view of its bytes, so the process holds each weight once, as file
pages; what a layout change must copy (``copy``) is read through a second, short-lived mapping, so
the pages of the original do not stay mapped too. The format (a little-endian u64 header length, a
JSON header of ``{name: {dtype, shape, data_offsets}}``, the data) is checked: a damaged file is one
line naming it.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path
from typing import Callable

import torch

from ncpctl.errors import UserError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {name: (dtype, shape, begin, end)}) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            size = path.stat().st_size
            if n is None or n > size - 8:
                raise ValueError("no header")
            head = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path}: damaged or truncated safetensors file ({e})") from None
    out = {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: damaged safetensors header at {name!r}") from None
        count = 1
        for s in shape:
            count *= s
        if not 0 <= b <= e <= size - 8 - n or e - b != count * torch.empty((), dtype=dtype).element_size():
            raise UserError(f"{path}: damaged safetensors header at {name!r} (offsets)")
        out[name] = (dtype, shape, b, e)
    return 8 + n, out


class MappedSafetensors:
    """The tensors of some safetensors files, by name, as views of their mappings."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, int, tuple]] = {}  # name -> (file, data offset, entry)
        self._maps: dict[Path, mmap.mmap] = {}
        for path in files:
            if not path.is_file():
                raise UserError(f"{path}: missing (the model directory is incomplete)")
            start, entries = _header(path)
            for name, entry in entries.items():
                self.where[name] = (path, start, entry)

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple:
        return self.where[name][2][1]

    def _view(self, mm: mmap.mmap, start: int, entry: tuple) -> torch.Tensor:
        dtype, shape, b, e = entry
        if e == b:
            return torch.empty(shape, dtype=dtype)
        n = (e - b) // torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(mm, dtype=dtype, count=n, offset=start + b).view(shape)

    def view(self, name: str) -> torch.Tensor:
        """Tensor ``name``, sharing the file's pages (mapped copy-on-write)."""
        path, start, entry = self.where[name]
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._view(self._maps[path], start, entry)

    def copy(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
        """``fn`` of tensor ``name`` as new memory, read through a mapping closed again here (so its
        pages leave the process: a reordered copy does not hold the original's pages too)."""
        path, start, entry = self.where[name]
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            with warnings.catch_warnings():  # a read-only buffer: the view is only read
                warnings.simplefilter("ignore", UserWarning)
                src = self._view(mm, start, entry)
            out = fn(src)
            out = out.clone(memory_format=torch.contiguous_format) if _shares(out, src) else out.contiguous()
            del src  # no view of the mapping may outlive it
        return out


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a's storage is b's (a view of the mapping that is about to close)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:
        return False
