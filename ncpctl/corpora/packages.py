"""``builtin:python-packages``: the ``.py`` files of the packages installed in the running
environment (its site-packages directories), one document per file, each with its package.

Syntax (the source's ``path``)::

    builtin:python-packages                          every installed package
    builtin:python-packages:include=sympy+numpy      only these packages
    builtin:python-packages:exclude=torch+sympy      all but these (hold them out)

This form needs no quoting anywhere: in a YAML flow list (``sources: [builtin:...]``, the
form recipes and ``--set data.sources=[...]`` use), in a block list, and in a shell. The URL
habit ``?include=sympy,numpy`` is accepted too (``?`` for ``:``, ``,`` for ``+``), but
PyYAML's flow lists split at ``,`` and reject ``?``, so it must be quoted there. Every name
must be an installed package; a selection names either packages to include or to exclude.

Package: the top-level import name, i.e. the first path component under site-packages
(``sympy/core/add.py`` -> ``sympy``; a top-level module ``six.py`` -> ``six``). A top-level
directory counts only if its name is an identifier (so ``*.dist-info`` and ``numpy.libs`` do
not). Namespace packages share their top-level name (``google/protobuf`` -> ``google``).

Left out: ``__pycache__``; test folders, i.e. directories named as in ``TEST_DIRS`` (the
stdlib source's definition; ``include_tests: true`` keeps them); vendored trees, i.e.
directories whose name without leading underscores starts with ``vendor`` (``_vendor``,
``vendored``, ``vendored_templates``) or is ``extern``, ``externals``, ``third_party``,
``thirdparty`` or ``3rdparty`` (``pip/_vendor``, ``joblib/externals``); and the finder
modules of editable installs (``__editable__*``), which are generated per install.

Deduplication by content, over the whole installed set *before* selection: files are put in
document order (package name, then the path inside the package, then the order of the
site-packages directories), and a file whose bytes equal an earlier file's is dropped, so the
earliest copy wins, deterministically. Because each distinct content belongs to exactly one
package before any selection, ``:include=X`` and ``:exclude=X`` split the unique files into
two disjoint sets: a held-out package's text never reaches training through a copy installed
elsewhere. Only files whose size equals another candidate's are hashed (about a tenth of the
bytes), and each hash is kept per process by (path, size, mtime).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
import site
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ncpctl.errors import UserError

SOURCE = "builtin:python-packages"
# Test suites, in the stdlib and in packages alike (``numpy/testing`` is library code: kept).
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_VENDORED = frozenset({"extern", "externals", "third_party", "thirdparty", "3rdparty"})
_KEYS = ("include", "exclude")

_digests: dict[tuple[str, int, int], bytes] = {}  # (path, size, mtime_ns) -> content hash
_listings: dict[tuple[str, bool, tuple[Path, ...]], "Listing"] | None = None  # inside cached_listings()


@dataclass(frozen=True)
class Selection:
    """Which packages a ``builtin:python-packages`` path selects."""

    source: str  # the path as written, for messages
    include: tuple[str, ...] | None = None  # None: every installed package
    exclude: tuple[str, ...] = ()

    def selects(self, package: str) -> bool:
        return (self.include is None or package in self.include) and package not in self.exclude


@dataclass(frozen=True)
class PackageFile:
    """One document of the corpus: a ``.py`` file and the package it belongs to."""

    package: str  # top-level import name
    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Listing:
    """What a selection reads: ``files`` in document order, and what was left out."""

    files: list[PackageFile]  # selected, deduplicated, in document order
    included: dict[str, int]  # package -> documents (files), sorted by name (= document order)
    held_out: list[str]  # installed packages the selection leaves out, sorted
    duplicates: int  # files of the selected packages dropped as copies of an earlier file
    roots: list[Path]  # the site-packages directories read


def is_packages_source(path: str) -> bool:
    return path == SOURCE or (path.startswith(SOURCE) and path[len(SOURCE)] in ":?")


def parse(path: str) -> Selection:
    """The selection of a ``builtin:python-packages[:include=A+B | :exclude=A+B]`` path."""
    query = path[len(SOURCE) + 1:]
    if not query:
        return Selection(path)
    key, eq, value = query.partition("=")
    if key not in _KEYS or not eq:
        raise UserError(f"{path}: {query!r} is not a selection; use {SOURCE}:include=NAME+NAME "
                        f"or {SOURCE}:exclude=NAME+NAME")
    if "=" in value:
        raise UserError(f"{path}: give either include= or exclude=, not both")
    names = tuple(n.strip() for n in re.split(r"[+,]", value))
    if not all(names):
        raise UserError(f"{path}: {key}= needs package names joined by '+', e.g. {SOURCE}:{key}=sympy+numpy")
    return Selection(path, names) if key == "include" else Selection(path, exclude=names)


def site_roots() -> list[Path]:
    """The running environment's site-packages directories that exist, in ``site``'s order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    out: list[Path] = []
    for d in dirs:
        p = Path(d).resolve()
        if p.is_dir() and p not in out:
            out.append(p)
    return out


@contextlib.contextmanager
def cached_listings() -> Iterator[None]:
    """Inside this block each selection is listed once. A command reads a source several times
    (fingerprint, document count, meta.json, two passes over the text); each listing walks
    site-packages (~0.5 s), and nothing there is expected to change during one command.
    Outside the block every call walks afresh."""
    global _listings
    outer = _listings
    _listings = {} if outer is None else outer
    try:
        yield
    finally:
        _listings = outer


def _skipped_dir(name: str, skip: frozenset[str]) -> bool:
    bare = name.lstrip("_")
    return name in skip or bare.startswith("vendor") or bare in _VENDORED


def _candidates(roots: list[Path], include_tests: bool) -> tuple[list[PackageFile], set[str]]:
    """Every ``.py`` file that could be a document, in document order (before dedup), and the
    names of all installed packages (also those without such a file)."""
    skip = frozenset({"__pycache__"}) | (frozenset() if include_tests else TEST_DIRS)
    keyed: list[tuple[str, tuple[str, ...], int, PackageFile]] = []
    names: set[str] = set()

    def add(package: str, path: str, i: int) -> None:
        st = os.stat(path)
        rel = Path(path).relative_to(roots[i]).parts
        keyed.append((package, rel, i, PackageFile(package, Path(path), st.st_size, st.st_mtime_ns)))

    for i, root in enumerate(roots):
        for entry in os.scandir(root):
            name = entry.name
            if name.startswith("__editable__"):
                continue
            if name.endswith(".py") and entry.is_file():
                names.add(name[:-3])
                add(name[:-3], entry.path, i)
            elif name.isidentifier() and not _skipped_dir(name, skip) and entry.is_dir():
                names.add(name)
                for dirpath, dirnames, filenames in os.walk(entry.path):
                    dirnames[:] = [d for d in dirnames if not _skipped_dir(d, skip)]
                    for f in filenames:
                        if f.endswith(".py"):
                            add(name, os.path.join(dirpath, f), i)
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed], names


def _digest(f: PackageFile) -> bytes:
    key = (str(f.path), f.size, f.mtime_ns)
    if key not in _digests:
        try:
            _digests[key] = hashlib.blake2b(f.path.read_bytes(), digest_size=16).digest()
        except OSError as e:
            raise UserError(f"{f.path}: cannot read ({e.strerror})") from None
    return _digests[key]


def _copies(files: list[PackageFile], wanted: Selection) -> set[int]:
    """Indices of files whose content equals an earlier file's. Only same-size groups that
    hold a selected file are hashed: the others cannot change what the selection reads."""
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, f in enumerate(files):
        by_size[f.size].append(i)
    copies: set[int] = set()
    for group in by_size.values():
        if len(group) < 2 or not any(wanted.selects(files[i].package) for i in group):
            continue
        first: dict[bytes, int] = {}
        for i in group:  # in document order: the first copy wins
            if first.setdefault(_digest(files[i]), i) != i:
                copies.add(i)
    return copies


def _check_names(sel: Selection, installed: set[str], roots: list[Path]) -> None:
    for name in (*(sel.include or ()), *sel.exclude):
        if name not in installed:
            near = difflib.get_close_matches(name, sorted(installed), n=1)
            where = ", ".join(map(str, roots)) or "no site-packages directory"
            raise UserError(f"{sel.source}: no installed package {name!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f"; packages are top-level import names under {where}")


def listing(path: str, include_tests: bool = False, roots: list[Path] | None = None) -> Listing:
    """The documents of a ``builtin:python-packages`` source (``roots``: default ``site_roots()``).

    Raises a one-line ``UserError`` naming the source for a bad selection, a package that is
    not installed, or a selection that leaves no file.
    """
    sel = parse(path)
    roots = site_roots() if roots is None else roots
    key = (path, include_tests, tuple(roots))
    if _listings is not None and key in _listings:
        return _listings[key]
    files, installed = _candidates(roots, include_tests)
    _check_names(sel, installed, roots)
    copies = _copies(files, sel)
    chosen = [f for i, f in enumerate(files) if sel.selects(f.package) and i not in copies]
    if not chosen:
        raise UserError(f"{path}: the selection matches no file (.py files outside test and vendored folders)")
    counts = Counter(f.package for f in chosen)
    included = {p: counts[p] for p in sorted(installed) if sel.selects(p)}  # 0: every file was a copy
    dropped = sum(1 for i in copies if sel.selects(files[i].package))
    out = Listing(files=chosen, included=included, held_out=sorted(p for p in installed if not sel.selects(p)),
                  duplicates=dropped, roots=roots)
    if _listings is not None:
        _listings[key] = out
    return out
