"""Property-based tests (Hypothesis; issue 42 item 7) of everything ncpctl reads from a file or the
command line: the recipe loader (YAML, ``extends``), ``--set``, a dataset's ``meta.json`` and
``.idx``, a checkpoint's manifest and the sweep file. Each property is the promise of docs/reliability.md's
"Reliability" section: whatever the input, the outcome is success or a ``UserError`` whose problems
are single lines (exit 2, one line each, through the CLI wrapper), never another exception (an
internal error), and nothing is written outside the directory the input names (an audit hook sees
every file opened for writing and every directory operation of the process).

The profile (tests/conftest.py) is derandomised, without deadlines and without an example
database, so the suite is the same run on any machine, however loaded; ``HYPOTHESIS_PROFILE=dev``
explores with fresh random examples. Examples per property are few (the suite's time); a failure
Hypothesis once found is kept below as an ``@example``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml
from hypothesis import example, given, settings, strategies as st

from ncpctl.errors import UserError

# ----------------------------------------------------------------------------- what is written

_WRITES: list[str] | None = None  # recording while not None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DIR_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.symlink", "os.link",
               "os.truncate", "os.chmod", "os.chown", "shutil.rmtree", "shutil.move", "os.utime"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WRITES is None:
        return
    target = args[0] if args else None
    if not isinstance(target, (str, bytes, os.PathLike)):
        return  # a file descriptor: its open was seen
    if event == "open":
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            _WRITES.append(os.fsdecode(target))
    elif event in _DIR_EVENTS:
        _WRITES.append(os.fsdecode(target))


sys.addaudithook(_audit)  # process-wide and permanent (Python has no removal): a no-op while not recording


@contextlib.contextmanager
def writes_only_under(root: Path) -> Iterator[None]:
    """Every file written (or directory changed) inside the block is under ``root`` (Python's own
    byte-code caches aside: a module imported for the first time)."""
    global _WRITES
    _WRITES = []
    try:
        yield
    finally:
        got, _WRITES = _WRITES, None
    top = os.path.realpath(root)
    outside = [w for w in got if not w.endswith((".pyc", ".pyc.tmp")) and "__pycache__" not in w
               and os.path.commonpath([top, os.path.realpath(os.path.join(top, w))]) != top]
    assert outside == [], f"written outside {root}: {outside[:5]}"


def one_line_each(e: UserError) -> None:
    """What the CLI prints for it is one ``error:`` line per problem: no problem is empty or spans lines."""
    assert e.problems and all(isinstance(p, str) and p.strip() and "\n" not in p for p in e.problems), e.problems


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh directory per example (Hypothesis runs many examples in one test call)."""
    with tempfile.TemporaryDirectory(prefix="ncpctl-prop-") as d:
        yield Path(d)


# ----------------------------------------------------------------------------- strategies
# (examples per property: the profile's max_examples, 60 in "ci" and 1000 in "dev"; tests/conftest.py)

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["", "..", "/", "/etc/passwd", "../../x", "~", "auto",
                                                          "builtin:python-stdlib", "hf:", "1e400", "null"]))


def _keys() -> st.SearchStrategy[Any]:
    """Recipe keys: the schema's section and field names, any text, and what YAML reads as a
    number, a boolean or null (``1:``, ``0E0:``, ``null:``)."""
    from ncpctl.recipe.schema import SECTIONS

    known = sorted({f for cls in SECTIONS.values() for f in cls.model_fields} | set(SECTIONS))
    return st.one_of(st.sampled_from(known), st.text(min_size=1, max_size=8), st.integers(-3, 3), st.none(),
                     st.booleans(), st.floats(-2, 2))


def values() -> st.SearchStrategy[Any]:
    return st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_keys(), inner, max_size=4)),
                        max_leaves=12)


def recipe_docs() -> st.SearchStrategy[Any]:
    """A recipe document: mostly the real sections with real and unknown keys, sometimes anything."""
    from ncpctl.recipe.schema import SECTIONS

    section = st.dictionaries(_keys(), values(), max_size=5)
    return st.one_of(st.fixed_dictionaries({}, optional={name: st.one_of(section, SCALARS) for name in SECTIONS}),
                     values())


def set_items() -> st.SearchStrategy[str]:
    """``--set`` items: well-formed key paths with YAML-ish values, and arbitrary text."""
    path = st.lists(st.one_of(_keys().map(str), st.sampled_from(["", " ", "model", "train", "concept"])), min_size=1,
                    max_size=4).map(".".join)
    raw = st.one_of(st.text(max_size=20), SCALARS.map(lambda v: json.dumps(v, default=str)),
                    st.sampled_from(["[1, 2", "{a: *b}", "&a [*a]", "!!python/object:os.system", "- x\n- y",
                                     "1e-4", ".inf", "[" * 200]))
    return st.one_of(st.builds(lambda k, v: f"{k}={v}", path, raw), st.text(max_size=30))


# ----------------------------------------------------------------------------- the recipe loader and --set

BASE = "model: {size: debug}\ntokenizer: {vocab_size: 512}\ntrain: {max_steps: 2, seq_len: 32, micro_batch_size: 2}\n"


@given(doc=recipe_docs(), raw=st.one_of(st.none(), st.text(max_size=80)))
@example(doc={1: None, "model": {None: 1, "size": "debug"}, "train": {3.5: 1}}, raw=None)  # found by Hypothesis
def test_any_recipe_loads_or_is_one_line_per_problem(doc: Any, raw: str | None) -> None:
    from ncpctl.recipe import load_recipe

    with scratch() as d, writes_only_under(d):
        path = d / "r.yaml"
        path.write_text(raw if raw is not None else yaml.safe_dump(doc, allow_unicode=True))
        try:
            load_recipe(path)
        except UserError as e:
            one_line_each(e)


@given(items=st.lists(set_items(), min_size=1, max_size=3))
@example(items=["\n"])  # found by Hypothesis: the item was quoted as it is, newline and all
def test_any_set_applies_or_is_one_line_per_problem(items: list[str]) -> None:
    from ncpctl.recipe import load_recipe

    with scratch() as d, writes_only_under(d):
        (d / "r.yaml").write_text(BASE + f"run: {{dir: {d / 'run'}}}\n")
        try:
            load_recipe(d / "r.yaml", items)
        except UserError as e:
            one_line_each(e)


@settings(max_examples=max(10, settings.default.max_examples // 2))  # two files per example
@given(parent=recipe_docs(), child=st.dictionaries(_keys(), values(), max_size=3),
       extends=st.one_of(st.just("parent.yaml"), st.lists(st.sampled_from(["parent.yaml", "r.yaml", "missing.yaml",
                                                                           "/dev/null", ".."]), max_size=3), SCALARS))
@example(parent={}, child={"0E0": None}, extends="parent.yaml")  # found by Hypothesis: a key YAML reads as 0.0
def test_extends_chains_load_or_are_one_line_per_problem(parent: Any, child: dict, extends: Any) -> None:
    from ncpctl.recipe import load_recipe

    with scratch() as d, writes_only_under(d):
        (d / "parent.yaml").write_text(yaml.safe_dump(parent))
        (d / "r.yaml").write_text(yaml.safe_dump({**child, "extends": extends}))
        try:
            load_recipe(d / "r.yaml")
        except UserError as e:
            one_line_each(e)


# ----------------------------------------------------------------------------- meta.json and the .idx

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                              st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4)), max_leaves=10)
META_FIELDS = {"tokenizer": st.one_of(JSON, st.fixed_dictionaries({}, optional={
    "vocab_size": JSON, "sha256": JSON, "eod_id": JSON, "special_tokens": JSON})),
    "splits": st.one_of(JSON, st.dictionaries(st.sampled_from(["train", "val"]), st.one_of(JSON, st.fixed_dictionaries(
        {}, optional={"tokens": JSON, "max_id": JSON, "documents_per_source": JSON})))),
    "labels": st.one_of(JSON, st.fixed_dictionaries({}, optional={"vocabulary": JSON, "document_level": JSON})),
    "source_labels": JSON}


def _dataset(d: Path, split: str = "train") -> Path:
    from ncpctl.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(d / split, np.uint16) as w:
        w.add_documents(np.arange(600) % 500, np.array([200] * 3))
    return d / split


@given(meta=st.one_of(JSON, st.fixed_dictionaries({}, optional=META_FIELDS)), raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_any_meta_json_is_read_or_one_line_and_its_readers_never_fail_otherwise(meta: Any, raw: bytes | None) -> None:
    """The reader (``ncpctl.data.meta``) and what pretrain does with what it passes: the vocabulary
    and special-token checks, a mixture's tokenizer check, the sources of validation."""
    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.data.mix import check_tokenizers
    from ncpctl.recipe import load_recipe
    from ncpctl.train.data import check_vocab
    from ncpctl.train.designs.dynamic import val_sources

    with scratch() as d, writes_only_under(d):
        (d / "r.yaml").write_text(BASE + f"run: {{dir: {d / 'run'}}}\n")
        recipe = load_recipe(d / "r.yaml")
        ds = IndexedDataset(_dataset(d))
        (d / "meta.json").write_bytes(raw if raw is not None else json.dumps(meta).encode())
        for check in (lambda: check_vocab(recipe, ds, 512), lambda: check_tokenizers([("a", 1.0, ds), ("b", 1.0, ds)]),
                      lambda: val_sources(ds, lambda m: None)):
            try:
                check()
            except UserError as e:
                one_line_each(e)


@given(header=st.tuples(st.sampled_from([b"MMIDIDX\x00\x00", b"TNTIDX\x00\x00\x00", b"garbage!!"]),
                        st.integers(0, 2), st.integers(0, 12), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
       small=st.tuples(st.integers(0, 4), st.integers(0, 4)),
       body=st.lists(st.integers(-2**31, 2**31 - 1), max_size=12), tail=st.binary(max_size=24),
       bin_bytes=st.integers(0, 64))
def test_any_idx_opens_or_is_one_line(header, small, body, tail, bin_bytes) -> None:
    """A .idx header with any counts (small ones, so that the arrays behind it can be read), any
    sizes / pointers / document index after it, any .bin length: ``IndexedDataset`` opens it (and
    then every sequence reads, and the window reader over it starts) or refuses in one line."""
    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.data.windows import WindowLoader

    magic, version, code, n, n_doc = header
    if small != (0, 0):
        n, n_doc = small
    with scratch() as d, writes_only_under(d):
        (d / "x.idx").write_bytes(struct.pack("<9sQBQQ", magic, version, code, n, n_doc)
                                  + np.asarray(body, dtype="<i4").tobytes() + tail)
        (d / "x.bin").write_bytes(bytes(bin_bytes))
        try:
            ds = IndexedDataset(d / "x")
            for i in range(len(ds)):
                ds[i]
            WindowLoader(ds, 4, 1, seed=0)
        except UserError as e:
            one_line_each(e)


# ----------------------------------------------------------------------------- a checkpoint's manifest

NAMES = st.one_of(st.sampled_from(["model.safetensors", "ncpctl.json", ".", "..", "../outside.txt", "/etc/hostname",
                                   "sub", "sub/", "fifo", "a\x00b", ""]), st.text(max_size=10))
ENTRY = st.one_of(JSON, st.fixed_dictionaries({"size": JSON, "xxh3_128": JSON}))


@given(files=st.one_of(JSON, st.dictionaries(NAMES, ENTRY, max_size=5)), algorithm=st.one_of(
    st.just("xxh3_128"), JSON), raw=st.one_of(st.none(), st.binary(max_size=30)))
@example(files={".": {"size": 4096, "xxh3_128": "0"}}, algorithm="xxh3_128", raw=None)
def test_any_manifest_verifies_or_names_one_problem(files: Any, algorithm: Any, raw: bytes | None) -> None:
    """``manifest.verify`` (what every checkpoint read runs) answers None or one phrase for any
    manifest.json: never an exception, never a file outside the checkpoint read or hashed."""
    from ncpctl import manifest

    with scratch() as d, writes_only_under(d):
        ck = d / "step_0000001"
        (ck / "sub").mkdir(parents=True)
        (ck / "model.safetensors").write_bytes(b"w" * 64)
        (ck / "ncpctl.json").write_text("{}")
        os.mkfifo(ck / "fifo")  # hashing it would wait for a writer forever
        (ck / "manifest.json").write_bytes(raw if raw is not None else
                                           json.dumps({"algorithm": algorithm, "files": files}).encode())
        for sizes_only in (True, False):
            why = manifest.verify(ck, sizes_only=sizes_only)
            assert why is None or (isinstance(why, str) and "\n" not in why)


# ----------------------------------------------------------------------------- the sweep file

SWEEP_KEYS = st.sampled_from(["model.d_model", "train.max_steps", "train.lr", "model.concept.k", "name", "bad key",
                              "x..y", "..", "model"])


def sweep_docs() -> st.SearchStrategy[Any]:
    listed = st.dictionaries(SWEEP_KEYS, st.one_of(st.lists(SCALARS, max_size=3), SCALARS), max_size=3)
    return st.one_of(values(), st.fixed_dictionaries({"base": st.one_of(st.just("base.yaml"), SCALARS)}, optional={
        "name": st.one_of(SCALARS, st.sampled_from(["..", ".", "../../escape", "a/b"])), "ranks": SCALARS,
        "axes": st.one_of(listed, SCALARS), "zip": st.one_of(listed, st.lists(listed, max_size=2), SCALARS),
        "points": st.one_of(st.lists(st.dictionaries(SWEEP_KEYS, st.one_of(SCALARS, st.sampled_from(
            ["..", ".", "a/../..", "/abs"])), max_size=3), max_size=3), SCALARS),
        "slurm": st.one_of(st.dictionaries(st.text(max_size=5), SCALARS, max_size=2), SCALARS),
        "timeout_min": SCALARS}))


@given(doc=sweep_docs(), raw=st.one_of(st.none(), st.text(max_size=60)))
@example(doc={"base": "base.yaml", "points": [{"name": "..", "train.max_steps": 3}, {"name": ".", "train.lr": 1}]},
         raw=None)
def test_any_sweep_file_reads_or_is_one_line_and_its_points_stay_in_its_directory(doc: Any, raw: str | None) -> None:
    """``read_sweep`` (what ``ncpctl sweep`` runs first): a sweep or one line; every point's run
    directory is a directory of its own inside OUT/runs (its name one path component)."""
    from ncpctl.study.sweep import RUNS, read_sweep

    with scratch() as d, writes_only_under(d):
        (d / "base.yaml").write_text(BASE)
        (d / "s.yaml").write_text(raw if raw is not None else yaml.safe_dump(doc, allow_unicode=True))
        try:
            sweep, _ = read_sweep(d / "s.yaml", out=str(d / "out"))
        except UserError as e:
            one_line_each(e)
            return
        runs = os.path.realpath(d / "out" / RUNS)
        for p in sweep.points:
            assert os.path.dirname(os.path.realpath(os.path.join(runs, p.name))) == runs, p.name


@pytest.mark.parametrize("text", ["[" * 1100 + "]" * 1100, "a: " + "{a: " * 1100])
def test_deeply_nested_inputs_are_one_line(tmp_path: Path, text: str) -> None:
    """Nesting deeper than the parsers' recursion (YAML, JSON): one line, not a RecursionError."""
    from ncpctl.data import meta
    from ncpctl.recipe import load_recipe
    from ncpctl.study.sweep import read_sweep

    for read in (load_recipe, lambda p: read_sweep(p), meta.read):
        path = tmp_path / "x"
        path.write_text(text)
        with pytest.raises(UserError) as e:
            read(path)
        one_line_each(e.value)


@settings(max_examples=max(10, settings.default.max_examples // 3))  # the real command: every point's recipe
@given(doc=sweep_docs())
def test_sweep_dry_exits_0_or_2_with_error_lines_and_writes_nothing(doc: Any) -> None:
    """``ncpctl sweep FILE --dry`` through the command itself (in-process): exit 0, or exit 2 with
    ``error:`` lines and no internal error; a dry run writes nothing at all."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    with scratch() as d:
        (d / "base.yaml").write_text(BASE)
        (d / "s.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
        with writes_only_under(d / "nothing"):
            r = CliRunner().invoke(app, ["sweep", str(d / "s.yaml"), "--dry", "--out", str(d / "out")],
                                   env={"COLUMNS": "200"})
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert (r.exit_code == 0 and not errors) or (r.exit_code == 2 and errors), (r.exit_code, r.output[-2000:])
        assert "internal error" not in r.output and not (d / "out").exists()
