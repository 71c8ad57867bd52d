"""Which files a built-in corpus is, and what kind of source a path names (``source_kind``).

Plain values in, paths or one-line problems out: ``ncpctl.recipe`` checks a recipe's built-in
sources with ``builtin_problem`` before anything is read; ``ncpctl.data.sources`` reads them.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from ncpctl.corpora import packages
from ncpctl.errors import UserError

BUILTIN_STDLIB = "builtin:python-stdlib"
BUILTIN_PACKAGES = packages.SOURCE
BUILTINS = (BUILTIN_STDLIB, BUILTIN_PACKAGES)
# Directories of the stdlib that are not stdlib source (test suites: packages.TEST_DIRS).
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def source_kind(path: str, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.startswith("builtin:"):
        return "builtin"
    if path.startswith("hf:"):
        return "hf"
    lower = path.lower()
    for ext, kind in ((".jsonl", "json"), (".json", "json"), (".jsonl.gz", "json"), (".parquet", "parquet")):
        if lower.endswith(ext):
            return kind
    return "text"


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _NOT_STDLIB if include_tests else _NOT_STDLIB | packages.TEST_DIRS
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out)


def builtin_files(path: str, include_tests: bool = False) -> list[Path]:
    """The files of the built-in corpus ``path`` (sorted, deterministic); an unknown corpus or a
    selection it does not take is a ``UserError``."""
    if path == BUILTIN_STDLIB:
        return stdlib_files(include_tests)
    if packages.is_packages_source(path):
        return [f.path for f in packages.listing(path, include_tests).files]
    if path.startswith((BUILTIN_STDLIB + ":", BUILTIN_STDLIB + "?")):
        raise UserError(f"{path}: {BUILTIN_STDLIB} takes no selection (only {BUILTIN_PACKAGES} does)")
    raise UserError(f"unknown builtin corpus {path!r}; available: {', '.join(BUILTINS)}")


def builtin_problem(path: str, include_tests: bool = False) -> str | None:
    """The one-line problem with the built-in corpus ``path`` (unknown, a bad package selection, no
    package selected), or None."""
    try:
        builtin_files(path, include_tests)
    except UserError as e:
        return e.problems[0]
    return None
