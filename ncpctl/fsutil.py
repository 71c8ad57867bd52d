"""Atomic, durable writes: the one way ncpctl writes a file it presents as complete.

A file is written to a temporary name in the same directory, flushed and fsynced, renamed
over the final name with ``os.replace`` (atomic on POSIX), and then the directory is fsynced
so that the rename itself survives a crash or power cut. Whoever reads the final name sees
the old file or the whole new one, never a torn one; if writing fails, the temporary file
is removed and the old file is left untouched.

* ``atomic_write(path, data)``: ``str`` (UTF-8) or ``bytes``.
* ``atomic_write_with(path, write)``: ``write(tmp_path)`` writes the file itself, for
  libraries that take a path (safetensors ``save_file``, ``Tokenizer.save``, matplotlib,
  the torch profiler's trace export).
* ``commit(tmp, path)``: the last three steps, for writers that stream into their own
  temporary file (the indexed-dataset builder).
* ``disk_errors(path)``: a full (ENOSPC, EDQUOT), read-only (EROFS) or forbidden (EACCES) file
  system inside it becomes a one-line ``UserError`` naming the file (``ncpctl.errors.disk_error``):
  the error's own file, else ``path``. Also a write error torch's own file writer reports without
  an errno ("unexpected pos ..."), when the file system of ``path`` is full or read-only.
* ``fsync_tree(root)``: fsync every file and directory under ``root``, before a whole
  temporary directory is renamed into place (``ncpctl tokenize``'s data directory; the
  Hugging Face export directory); then ``fsync_dir`` the parent after the rename.

Stdlib only, so anything may import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Callable, Iterator

from ncpctl.errors import DISK_ERRNOS, UserError, disk_error

PathLike = str | os.PathLike[str]


def _tmp_name(path: Path) -> Path:
    # hidden and per process: two processes writing the same file never share a temporary
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_file(path: PathLike) -> None:
    """Flush ``path``'s data to the device (opened read-only: fsync needs no write access)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot sync a directory; the data is synced already
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def commit(tmp: PathLike, path: PathLike) -> None:
    """fsync the finished ``tmp``, rename it to ``path`` (atomic), fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def atomic_write_with(path: PathLike, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` writes the content to ``tmp`` (same directory); then ``commit`` it to
    ``path``. A failing ``write`` leaves ``path`` as it was and no temporary file behind."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with disk_errors(path):
            write(tmp)
            commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write(path: PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically and durably."""
    raw = data.encode() if isinstance(data, str) else data

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(raw)

    return atomic_write_with(path, write)


def fsync_tree(root: PathLike) -> None:
    """fsync every file and directory under ``root`` (files first, directories bottom-up),
    so a directory renamed into place afterwards holds only data that is on the device."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


def _full_or_read_only(path: PathLike) -> str | None:
    """What ``statvfs`` says is wrong with the file system holding ``path`` (or its nearest
    existing parent): read-only, or (almost) no space left; None if neither."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return DISK_ERRNOS[errno.EROFS]
    if st.f_bavail * st.f_frsize < (1 << 20):
        return DISK_ERRNOS[errno.ENOSPC]
    return None


@contextlib.contextmanager
def disk_errors(path: PathLike, doing: str = "writing") -> Iterator[None]:
    """Turn a full, read-only or forbidden file system under ``path`` into one line (exit 2)."""
    try:
        yield
    except OSError as e:
        err = disk_error(e, path, doing)
        if err is None:
            raise
        raise err from None
    except RuntimeError as e:  # torch's C++ file writer: "unexpected pos 4025536 vs 4025428", no errno
        meaning = _full_or_read_only(path)
        if meaning is None:
            raise
        code = next(k for k, v in DISK_ERRNOS.items() if v == meaning)
        err = disk_error(OSError(code, meaning), path, doing)
        assert err is not None
        detail = (str(e).strip().splitlines() or [""])[0][-100:]
        raise UserError(f"{err.problems[0]} ({detail})", hint=err.hint) from None
