"""``ncpctl.runlock``: one writer per run directory (issue 21 item 3)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.runlock import LOCK, RunLock


def _lock(run: Path, warnings: list[str], **kw) -> RunLock:
    return RunLock(run, "pretrain", warn=warnings.append, **kw)


def test_the_lock_names_its_owner_refuses_a_second_taker_and_is_released(tmp_path: Path) -> None:
    warnings: list[str] = []
    with _lock(tmp_path / "run", warnings) as held:
        owner = json.loads(held.path.read_text())
        stat = Path(f"/proc/{os.getpid()}/stat").read_text()  # the owner's start time: field 22
        started = int(stat[stat.rfind(")") + 2:].split()[19])
        assert owner == {"host": socket.gethostname(), "pid": os.getpid(), "started": started, "command": "pretrain"}
        with pytest.raises(UserError, match=rf"in use by pid {os.getpid()} on host .*`ncpctl pretrain`"):
            _lock(tmp_path / "run", warnings).acquire()  # a second open file: flock conflicts in one process too
    assert not (tmp_path / "run" / LOCK).exists() and warnings == []
    with _lock(tmp_path / "run", warnings):  # free again
        pass


def test_a_stale_lock_of_this_host_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead)}))
    warnings: list[str] = []
    with _lock(tmp_path, warnings) as held:
        assert json.loads(held.path.read_text())["pid"] == os.getpid()
    assert len(warnings) == 1 and f"stale lock of pid {dead}" in warnings[0]


def test_a_lock_from_another_host_is_refused_unless_broken(tmp_path: Path) -> None:
    (tmp_path / LOCK).write_text(json.dumps({"host": "gpu-node-17", "pid": 4242, "command": "midtrain"}))
    warnings: list[str] = []
    with pytest.raises(UserError, match="locked by pid 4242 on host gpu-node-17") as e:
        _lock(tmp_path, warnings).acquire()
    assert "--break-lock" in (e.value.hint or "")
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "gpu-node-17"  # untouched
    with _lock(tmp_path, warnings, break_lock=True):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert len(warnings) == 1 and "broke the lock of pid 4242 on host gpu-node-17" in warnings[0]


def test_holder_names_a_live_or_remote_owner_and_not_a_stale_one(tmp_path: Path) -> None:
    """``holder`` (what ``ncpctl sweep`` asks before it starts a point) reads the lock without taking it."""
    from ncpctl.runlock import holder

    run = tmp_path / "run"
    assert holder(run) is None  # no run directory, no lock
    with _lock(run, []):
        assert holder(run) == f"pid {os.getpid()} on host {socket.gethostname()} (`ncpctl pretrain`)"
    assert holder(run) is None  # released
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (run / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead)}))
    assert holder(run) is None  # a dead pid of this host: stale, a run would take it over
    (run / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": int(dead)}))
    assert holder(run) == f"pid {dead} on host elsewhere"


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_lock_path_that_is_not_a_regular_file_is_one_line(tmp_path: Path, kind: str) -> None:
    """Issue 42 item 6: ``ncpctl.lock`` as a directory was an internal IsADirectoryError; a link is
    not followed (it could point at any file, which the lock would truncate), a FIFO not waited on."""
    from ncpctl.runlock import holder

    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("someone's file\n")
    path = run / LOCK
    {"directory": path.mkdir, "symlink": lambda: path.symlink_to(target), "fifo": lambda: os.mkfifo(path)}[kind]()
    with pytest.raises(UserError) as e:
        _lock(run, []).acquire()
    what = {"directory": "a directory", "symlink": "a symbolic link", "fifo": "not a regular file"}[kind]
    assert e.value.problems == [f"{path}: is {what}, not the lock file ncpctl writes there"]
    assert target.read_text() == "someone's file\n" and os.path.lexists(path)
    assert holder(run) is None  # and reading it (ncpctl sweep) neither fails nor waits


@pytest.mark.parametrize("pid", [0, -1, 1 << 70, True, "12"])
def test_an_implausible_pid_in_the_lock_is_no_owner(tmp_path: Path, pid) -> None:
    """os.kill(0 or -1) would signal whole process groups, 2**70 overflows: such a content names no owner."""
    from ncpctl.runlock import holder

    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert holder(tmp_path) is None
    warnings: list[str] = []
    with _lock(tmp_path, warnings):
        pass
    assert warnings and "a process that left no owner" in warnings[0]
