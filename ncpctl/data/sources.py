"""Corpus sources: local text / jsonl / parquet files and globs, hub datasets, and the
zero-download built-in corpora ``builtin:python-stdlib`` (the running interpreter's stdlib,
the default) and ``builtin:python-packages`` (the ``.py`` files of every installed package,
with a package selection: ``builtin:python-packages:exclude=sympy``; see ``packages``).

Structured files (jsonl, parquet) and hub datasets are read through ``datasets``. Plain
text and the built-in corpora are read as bytes here so that a file with undecodable bytes
is skipped and counted instead of aborting the whole run.

The reader's public interface (used by ``tokenize`` and by anything else that reads the
sources a recipe names, e.g. evaluation on held-out text), stable:

- ``SourceSpec(path=...)`` (``ncpctl.recipe.schema``): one source, the same syntax as an entry
  of ``data.sources``; e.g. ``SourceSpec(path="builtin:python-packages:include=sympy")``.
- ``iter_documents(src, stats, batch=1024)``: batches (lists) of document texts, in a
  deterministic order; ``stats`` (a ``ReadStats``) counts what was skipped. A bad source is
  a ``UserError`` (one line naming it).
- ``source_problem(src)``: the one-line problem with a source, or None (a directory listing;
  no tokenizing).
- ``fingerprint(sources)``: a cheap identity of the inputs (file paths, sizes, mtimes).
- ``source_slug(path)`` / ``source_labels(sources)``: a short name per source, from the path's
  last two parts (``builtin:python-stdlib`` -> ``python_stdlib``), made unique; per-source
  metrics (validation's tokens per concept) and held-out task names use them.
- ``package_listing(src)``: for ``builtin:python-packages``, the documents in the same order
  as ``iter_documents`` yields them (each ``.package`` and ``.path``; undecodable files are
  skipped by the reader), the document count per included package, the held-out packages,
  and the number of duplicate files dropped. ``meta.json`` stores its summary
  (``package_summary``) under ``packages``.
- ``packages.cached_listings()`` (``ncpctl.corpora.packages``): a context manager; inside it each ``builtin:python-packages``
  selection walks site-packages once however often it is read (``tokenize`` uses it).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ncpctl.corpora import packages
from ncpctl.corpora.builtin import BUILTIN_PACKAGES, BUILTIN_STDLIB, BUILTINS, builtin_files, source_kind, stdlib_files  # noqa: F401 (this module's API)
from ncpctl.errors import UserError
from ncpctl.recipe.schema import SourceSpec



@dataclass
class ReadStats:
    """Counts of what reading skipped, reported to the user and stored in meta.json."""

    undecodable: int = 0  # documents (files) skipped for invalid UTF-8
    undecodable_examples: list[str] = field(default_factory=list)
    too_short: int = 0  # documents under data.min_chars


def package_listing(src: SourceSpec) -> packages.Listing:
    """The documents of a ``builtin:python-packages`` source, with their packages (see ``packages``)."""
    if not packages.is_packages_source(src.path):
        raise ValueError(f"not a {BUILTIN_PACKAGES} source: {src.path!r}")
    return packages.listing(src.path, src.include_tests)


def package_summary(src: SourceSpec) -> dict[str, Any]:
    """What meta.json records for a ``builtin:python-packages`` source: documents per included
    package, the held-out packages (installed, left out by the selection), duplicates dropped."""
    lst = package_listing(src)
    return {"included": lst.included, "held_out": lst.held_out, "duplicates_dropped": lst.duplicates,
            "site_packages": [str(r) for r in lst.roots]}


def source_problem(src: SourceSpec) -> str | None:
    """The one-line problem with a source (unknown builtin, bad package selection, no file
    matching a glob), or None. Hub datasets are not contacted here."""
    kind = source_kind(src.path, src.type)
    if kind == "hf":
        return None if src.path.removeprefix("hf:") else "hf: needs a dataset name, e.g. hf:wikitext"
    try:
        source_files(src)
    except UserError as e:
        return e.problems[0]
    return None


def source_files(src: SourceSpec) -> list[Path]:
    """Local files a file-based source refers to (sorted, deterministic)."""
    kind = source_kind(src.path, src.type)
    if kind == "builtin":
        return builtin_files(src.path, src.include_tests)
    if kind == "hf":
        return []
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(src.path), recursive=True) if Path(p).is_file())
    if not files:
        raise UserError(f"no file matches {src.path!r}")
    return files


def fingerprint(sources: list[SourceSpec]) -> str:
    """Cheap identity of the inputs: every file's path, size and mtime, plus the options.

    Like make: a changed file changes its size or mtime. Hub datasets are identified by name.
    """
    h = hashlib.sha256()
    for src in sources:
        h.update(json.dumps(src.model_dump(mode="json"), sort_keys=True).encode())
        if source_kind(src.path, src.type) == "builtin":
            h.update(sys.version.encode())
        for f in source_files(src):
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


MAX_SLUG = 48


def source_slug(path: str) -> str:
    """A short name for a source path: its last two parts (wildcard-only parts left out),
    lower-case, non-alphanumerics as ``_``: ``/data/notes/*.md`` -> ``notes_md``,
    ``builtin:python-stdlib`` -> ``python_stdlib``; ``corpus`` when nothing is left."""
    path = re.sub(r"^(builtin|hf):", "", path)
    parts = [p for p in re.split(r"[/\\]+", path) if p.strip("*?.~")]
    slug = re.sub(r"[^a-z0-9]+", "_", "_".join(parts[-2:]).lower()).strip("_")
    return slug[-MAX_SLUG:].lstrip("_") or "corpus"


def source_labels(sources: list[SourceSpec]) -> list[str]:
    """One label per ``data.sources`` entry, in order: ``source_slug`` of its path, with ``_2``,
    ``_3`` ... appended to the later ones of a repeated slug (two globs in one directory)."""
    labels: list[str] = []
    for src in sources:
        base, n = source_slug(src.path), 1
        label = base
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels.append(label)
    return labels


def count_documents(src: SourceSpec) -> int | None:
    """Number of documents if cheap to know (for the progress bar), else None."""
    kind = source_kind(src.path, src.type)
    if kind in ("builtin", "text") and src.sample_by == "document":
        return len(source_files(src))
    return None


def _split_text(text: str, sample_by: str) -> list[str]:
    if sample_by == "document":
        return [text]
    if sample_by == "line":
        return [line for line in text.splitlines() if line.strip()]
    return [p for p in text.split("\n\n") if p.strip()]


def _iter_files_as_text(src: SourceSpec, stats: ReadStats) -> Iterator[str]:
    for f in source_files(src):
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            stats.undecodable += 1
            if len(stats.undecodable_examples) < 3:
                stats.undecodable_examples.append(str(f))
            continue
        except OSError as e:
            raise UserError(f"{f}: cannot read ({e.strerror})") from None
        yield from _split_text(text, src.sample_by)


def _load_with_datasets(src: SourceSpec, kind: str):  # -> datasets.Dataset
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        if kind == "hf":
            name = src.path.removeprefix("hf:")
            return datasets.load_dataset(name, src.name, split=src.split)
        files = [str(f) for f in source_files(src)]
        return datasets.load_dataset(kind, data_files=files, split="train")
    except UserError:
        raise
    except Exception as e:  # datasets raises many types; the user needs one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "the hub (is it reachable? set HF_DATASETS_OFFLINE=0)" if kind == "hf" else "its files"
        raise UserError(f"data source {src.path!r}: cannot load from {where}: {first[:300]}") from None


def iter_documents(src: SourceSpec, stats: ReadStats, batch: int = 1024,
                   extra_field: str | None = None) -> Iterator[list[Any]]:
    """Batches of document texts from one source, in a deterministic order. With
    ``extra_field`` (concept labels, ``ncpctl.data.labels``) each item is ``(text, value)``: the
    record's value of that field (None where a record or a plain-text source has none)."""
    kind = source_kind(src.path, src.type)
    if kind in ("builtin", "text"):
        buf: list[Any] = []
        for doc in _iter_files_as_text(src, stats):
            buf.append(doc if extra_field is None else (doc, None))
            if len(buf) == batch:
                yield buf
                buf = []
        if buf:
            yield buf
        return
    ds = _load_with_datasets(src, kind)
    if src.field not in ds.column_names:
        raise UserError(f"data source {src.path!r}: no field {src.field!r} (fields: {', '.join(ds.column_names)}); "
                        "set `field:` in the source")
    extra = extra_field if extra_field is not None and extra_field in ds.column_names else None
    for rows in ds.select_columns([src.field] + ([extra] if extra else [])).iter(batch_size=batch):
        texts = rows[src.field]
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise UserError(f"data source {src.path!r}: field {src.field!r} holds {type(texts[bad[0]]).__name__}, not text")
        if extra_field is None:
            yield texts
        else:
            yield list(zip(texts, rows[extra] if extra else [None] * len(texts)))


def documents(data: Any, stats: ReadStats, extra_field: str | None = None,
               starts: list[int] | None = None) -> Iterator[tuple[Any, ...]]:
    """(global document indices, texts) batches over all sources of the data section ``data``, honouring min_chars/max_documents;
    with ``extra_field`` (concept labels) (indices, texts, each record's value of that field).
    ``starts``: gets each source's first global index appended as its reading begins (the
    sources are read in order, so document i is from source ``searchsorted(starts, i, 'right') - 1``)."""
    d = data  # a recipe's data section (DataSection)
    index = 0
    for src in d.sources:
        if starts is not None:
            starts.append(index)
        for items in iter_documents(src, stats, batch=d.batch_documents, extra_field=extra_field):
            if d.max_documents is not None:
                items = items[: max(0, d.max_documents - index)]
            texts = items if extra_field is None else [t for t, _ in items]
            idx = np.arange(index, index + len(texts))
            index += len(texts)
            keep = [i for i, t in enumerate(texts) if len(t) >= max(d.min_chars, 1)]
            stats.too_short += len(texts) - len(keep)
            if len(keep) != len(texts):
                idx, texts, items = idx[keep], [texts[i] for i in keep], [items[i] for i in keep]
            if texts:
                yield (idx, texts) if extra_field is None else (idx, texts, [v for _, v in items])
            if d.max_documents is not None and index >= d.max_documents:
                return
