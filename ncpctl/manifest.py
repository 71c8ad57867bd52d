"""Checkpoint manifests: every file's size and xxh3-128 checksum (issue 21 item 4).

``manifest.json`` in a checkpoint directory::

    {"algorithm": "xxh3_128", "files": {"model.safetensors": {"size": 1234, "xxh3_128": "9f..."}, ...}}

It is written last (after every file, ``ncpctl.json`` included, and before ``latest`` names the
checkpoint), atomically and fsynced, so a checkpoint with a manifest is whole as written; reading
it back with ``verify`` finds a file that changed since (a flipped bit, a truncation, a file lost).
xxh3-128 (the ``xxhash`` library) runs at memory speed, a few GB/s per core
(``bench/checksum.py`` measures it); it guards against damage, not against an attacker who can
rewrite the manifest too.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path
from typing import Any, Iterable

from ncpctl.fsutil import atomic_write

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_128"
_CHUNK = 64 << 20


def file_hash(path: Path) -> str:
    """xxh3-128 of the file's bytes (hex), read through mmap in 64 MiB pieces."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                for start in range(0, size, _CHUNK):
                    h.update(view[start:start + _CHUNK])
                view.release()
    return h.hexdigest()


def files_of(directory: Path) -> list[str]:
    """Every regular file under ``directory`` (relative, sorted), but the manifest itself and
    hidden files (temporaries of an atomic write, a rank's share of the manifest)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            if not name.startswith(".") and rel != MANIFEST and os.path.isfile(os.path.join(dirpath, name)):
                out.append(rel)
    return sorted(out)


def describe(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {n: {"size": (directory / n).stat().st_size, ALGORITHM: file_hash(directory / n)} for n in names}


def write(directory: Path, entries: dict[str, dict[str, Any]]) -> None:
    atomic_write(directory / MANIFEST, json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))},
                                                  indent=1) + "\n")


def read(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file entries; None when there is none or it is unreadable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict) or \
                not all(isinstance(e, dict) for e in files.values()):
            return None
        return files
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _own(name: str) -> bool:
    """A name a manifest may list: relative, inside the directory (no ``..``, no ``.``), no NUL."""
    parts = name.split("/")
    return bool(name) and "\0" not in name and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def verify(directory: Path, *, sizes_only: bool = False) -> str | None:
    """What is wrong with ``directory`` against its manifest (one phrase), or None if every file
    listed is there with its size and checksum. ``sizes_only``: the cheap check (no reading)."""
    files = read(directory)
    if files is None:
        exists = (directory / MANIFEST).exists()
        return f"{MANIFEST} is {'unreadable' if exists else 'missing'}"
    for name, entry in files.items():
        if not _own(name):
            return f"{MANIFEST} lists {name[:80]!r}, which is not a file inside the checkpoint"
        path = directory / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:  # ENOTDIR: a part of the name is a file
            return f"{name} cannot be read ({e.strerror})"
        if not stat.S_ISREG(st.st_mode):  # a directory, a link, a FIFO: never what ncpctl listed
            return f"{name} is not a regular file"
        size = st.st_size
        if size != entry.get("size"):
            return f"{name} has {size:,} bytes, the manifest says {entry.get('size')}"
        if not sizes_only and file_hash(path) != entry.get(ALGORITHM):
            return f"{name} does not match its {ALGORITHM} checksum (damaged on disk)"
    return None
