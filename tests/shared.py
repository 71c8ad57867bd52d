"""Read-only fixtures built once per test run and shared by every xdist worker.

``./dev.sh test`` runs ``pytest -n 2``: each worker is its own process with its own session, so a
``scope="session"`` fixture is built once per worker. Where the result is only read (trained debug
checkpoints, a tokenized corpus), :func:`shared` builds it once in the run's base temporary
directory, which the workers share (xdist gives worker ``gwN`` the base temp ``<run's>/popen-gwN``),
under a file lock: the first worker to ask builds, the others wait for it and reuse the result.

A stale build is never reused: the directory's name carries a hash of the builder's source files,
the run's base temp is new for every run, and a build that died half-way (no ``.digest`` file)
is removed and made again. Consumers must not write into it (a test that writes copies it first):
the teardown compares the tree with the digest taken after the build and fails naming what changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

DIGEST = ".digest"


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes, or "-> target" for a link} of every file under ``root``
    (links are not followed: a shared fixture may link one part to another)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]):
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if rel == DIGEST:
                continue
            out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _run_temp(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: <run's base>/popen-gwN


def shared(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object], *sources: Path,
           ) -> Iterator[Path]:
    """Generator for a ``scope="session"`` fixture: yields the directory ``build(root)`` filled,
    built once per run for all workers; keyed by the bytes of ``sources`` (the builder's files)."""
    key = hashlib.sha256(b"".join(Path(s).read_bytes() for s in sources)).hexdigest()[:12]
    root = _run_temp(factory) / f"shared-{name}-{key}"
    with FileLock(f"{root}.lock"):
        if not (root / DIGEST).is_file():
            shutil.rmtree(root, ignore_errors=True)  # a build that died half-way
            root.mkdir(parents=True)
            build(root)
            (root / DIGEST).write_text("".join(f"{k}\t{v}\n" for k, v in sorted(tree_digest(root).items())))
    built = dict(line.split("\t", 1) for line in (root / DIGEST).read_text().splitlines())
    yield root
    now = tree_digest(root)
    changed = sorted(k for k in built.keys() | now.keys() if built.get(k) != now.get(k))
    assert not changed, (f"a test wrote into the shared fixture {root} (copy it first: tests/shared.py): "
                         f"{changed[:10]}")
