"""One writer per run directory: ``RUN/ncpctl.lock`` (issue 21).

The training commands (``pretrain``, ``midtrain``, ``adapt-vq``) hold the lock for the whole
run; readers (``eval``, ``export``, ``generate``) never take it (they pin the checkpoint they
read instead, ``ncpctl.checkpoint.resolve``). The lock is two things at once:

* an exclusive ``flock`` on the lock file, which the kernel drops when the process dies (also
  on ``kill -9``), so a second run on this host is refused while the first lives, and only then;
* the owner's host, pid and start time as the file's content, written after the flock is held, so a
  refusal names the owner, and a lock left by a dead process of this host is recognised (its pid is
  gone, or is now another process's: the start time differs) and taken over with a warning. A
  lock whose content names another host is refused even when its flock is free (``flock`` over
  network file systems is not to be trusted): the owner may live there. ``--break-lock`` takes
  it anyway (``ncpctl sweep --break-lock`` passes it on).

The file is removed on release (while still flocked; a process that opened the old file then
finds it unlinked and retries on the new one).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any, Callable

from ncpctl.errors import UserError

LOCK = "ncpctl.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` from field 3 (the state) on; empty where there is no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, ``/proc/PID/stat`` field 22): with the pid
    it names one process, so a pid the kernel has since given to another is not taken for the owner.
    None where there is no ``/proc`` (the pid alone then decides)."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the owner (of this host) still runs: its pid lives (not a zombie, which holds its pid until
    reaped) and, where both are known, started when the lock says."""
    if not _pid_alive(owner["pid"]):
        return False
    fields = _stat(owner["pid"])
    if fields and fields[0] == "Z":
        return False
    recorded, now = owner.get("started"), _started(owner["pid"])
    return not isinstance(recorded, int) or now is None or recorded == now


def _owner(text: str) -> dict[str, Any] | None:
    """The owner the lock's content names, or None (not JSON, no plausible pid: a stale or foreign file)."""
    try:
        owner = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(owner, dict):
        return None
    pid = owner.get("pid")
    if not (type(pid) is int and 0 < pid < 1 << 31):  # os.kill(0 or -1) would signal groups; a huge one overflows
        return None
    return owner


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "a process that left no owner"
    return f"pid {owner['pid']} on host {owner.get('host', '?')}" + (
        f" (`ncpctl {owner['command']}`)" if owner.get("command") else "")


class RunLock:
    """``with RunLock(run_dir, command, warn=..., break_lock=False):`` holds ``run_dir/ncpctl.lock``."""

    def __init__(self, run_dir: Path, command: str, *, warn: Callable[[str], None],
                 break_lock: bool = False) -> None:
        self.path = Path(run_dir) / LOCK
        self.command, self.warn, self.break_lock = command, warn, break_lock
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # retried only when the file we flocked was unlinked under us
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                text = os.pread(fd, 1 << 16, 0).decode(errors="replace")  # the owner's, through our own fd
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise UserError(f"{self.path}: the run directory is in use by {_describe(_owner(text))}",
                                hint="wait for that run to end, or give this run its own run.dir") from None
            if os.fstat(fd).st_ino != getattr(self._stat(), "st_ino", None):
                os.close(fd)  # released and removed by its owner between our open and flock
                continue
            self.fd = fd
            self._check_previous_owner()
            self._write_owner()
            return
        raise UserError(f"{self.path}: could not take the run lock (it keeps changing)")

    def _open(self) -> int:
        """The lock file, opened (created when absent). Never through a symbolic link, and only a
        regular file: a directory or a FIFO there is one line naming it (issue 42)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.EMLINK):
                raise
            fd = None
        if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        mode = os.fstat(fd).st_mode if fd is not None else os.lstat(self.path).st_mode
        if fd is not None:
            os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                else "not a regular file")
        raise UserError(f"{self.path}: is {kind}, not the lock file ncpctl writes there",
                        hint="move it out of the run directory (the run creates its own lock file)")

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.path)
        except FileNotFoundError:
            return None

    def _check_previous_owner(self) -> None:
        """The flock is ours; what does the content say about who had it before?"""
        assert self.fd is not None
        text = os.pread(self.fd, 1 << 16, 0).decode(errors="replace")
        if not text.strip():
            return  # a fresh file
        owner, host = _owner(text), socket.gethostname()
        if owner is not None and owner.get("host") != host:
            if not self.break_lock:
                self.release(remove=False)
                raise UserError(f"{self.path}: the run directory is locked by {_describe(owner)}",
                                hint="if that run is gone, rerun with --break-lock")
            self.warn(f"{self.path}: broke the lock of {_describe(owner)} (--break-lock)")
        elif owner is not None and owner["pid"] != os.getpid() and _alive(owner) and not self.break_lock:
            # the flock was free, yet the owner lives: a file system without working flock
            self.release(remove=False)
            raise UserError(f"{self.path}: the run directory is in use by {_describe(owner)}",
                            hint="wait for that run to end, or rerun with --break-lock if it is not an ncpctl run")
        else:
            self.warn(f"{self.path}: took over the stale lock of {_describe(owner)} (no longer running)")

    def _write_owner(self) -> None:
        assert self.fd is not None
        data = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
                           "command": self.command}) + "\n"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data.encode(), 0)
        os.fsync(self.fd)

    def release(self, remove: bool = True) -> None:
        if self.fd is None:
            return
        if remove:
            try:
                if getattr(self._stat(), "st_ino", None) == os.fstat(self.fd).st_ino:
                    self.path.unlink()
            except OSError:
                pass  # a read-only or vanished run directory: the flock still goes with the close
        os.close(self.fd)  # drops the flock
        self.fd = None


def holder(run_dir: Path, *, break_lock: bool = False) -> str | None:
    """Who holds ``run_dir``'s lock, as a refusal would name them, or None when a run could take it.

    Read from the lock file's content only (never by taking the flock, which would make a run
    starting at that moment refuse): a live process of this host, or any owner on another host
    (which ``RunLock`` refuses without ``--break-lock``; with ``break_lock`` only the live owner of
    this host, whom the flock refuses anyway). A dead pid of this host, or a pid that now names
    another process (its start time differs), is a stale lock.
    """
    path = Path(run_dir) / LOCK
    try:  # never through a link, never blocking on a FIFO; a directory there reads as no owner
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            text = os.read(fd, 1 << 16).decode(errors="replace") if stat.S_ISREG(os.fstat(fd).st_mode) else ""
        finally:
            os.close(fd)
    except OSError:
        return None
    owner = _owner(text)
    if owner is None:
        return None
    if owner.get("host") != socket.gethostname():
        return None if break_lock else _describe(owner)
    return _describe(owner) if _alive(owner) else None
