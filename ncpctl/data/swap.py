"""Putting a finished dataset directory in place (``ncpctl tokenize``): renames only, every file
fsynced first, and the leftovers of killed runs cleaned up."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ncpctl.fsutil import fsync_dir, fsync_tree


def swap_in(tmp: Path, data_dir: Path) -> None:
    """Replace ``data_dir`` with the complete ``tmp`` using renames (never a half state that
    looks complete: meta.json only exists in a whole directory). Every file of ``tmp`` is
    fsynced before the rename and the parent directory after it, so a power cut cannot leave
    a ``data/`` whose files are still only in the page cache."""
    fsync_tree(tmp)
    old = None
    if data_dir.exists():
        old = data_dir.with_name(f".data.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(data_dir, old)
    os.replace(tmp, data_dir)
    fsync_dir(data_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_tmp(run_dir: Path) -> None:
    """Leftovers of killed runs (.data.tmp-PID / .data.old-PID whose PID is gone)."""
    for p in run_dir.glob(".data.*-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if p.name.startswith(".data.old-") and not (run_dir / "data").exists():
                os.replace(p, run_dir / "data")  # killed between the two renames: restore
            else:
                shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
