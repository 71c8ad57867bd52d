"""Concept labels as data (ncpctl.data.labels): the python-ast labeller's spans, character spans
to token spans, ``tokenize`` writing PREFIX.labels.npy aligned with the token stream (checked
token by token against the spans re-derived from each document), the loader's per-window
evidence, and bad input (a span outside its document, a label file that disagrees with the
token stream) as one error line with no dataset half-written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.labels import PYTHON_CONCEPTS, LabelSpans, python_ast_spans, token_spans
from ncpctl.data.windows import WindowLoader

from ..conftest import run_cli

SOURCE = '''"""Module doc."""
import re
from pathlib import Path


@dataclass
class Reader(Base):
    """Reads."""

    def read(self, path: Path) -> str:
        try:
            with open(path) as f:
                return f"{path}: " + f.read()
        except OSError as e:
            raise ValueError("bad %s" % path) from e

    async def fetch(self):
        await self.go([x for x in range(3)])


def test_reader():
    assert re.match(r"a", "a")
'''


def test_python_ast_labeller_marks_what_it_says():
    spans = python_ast_spans(SOURCE)
    got = {}
    for a, b, name in spans:
        got.setdefault(name, []).append(SOURCE[a:b])
    assert set(got) <= set(PYTHON_CONCEPTS)
    assert got["class_definition"] == ["class Reader(Base):"]
    assert got["function_definition"] == ["def read(self, path: Path) -> str:", "async def fetch(self):",
                                          "def test_reader():"]
    assert got["exception_handling"] == ["try:", "except OSError as e:", 'raise ValueError("bad %s" % path) from e']
    assert got["regular_expressions"] == ['re.match(r"a", "a")'] and got["file_io"] == ["open(path)", "f.read()"]
    assert got["decorators"] == ["dataclass"] and got["type_hints"] == ["Path", "str"]
    assert set(got["string_formatting"]) == {'f"{path}: "', '"bad %s" % path'}
    assert got["tests"] == ["def test_reader():", 'assert re.match(r"a", "a")']
    assert got["async_code"] == ["async def fetch(self):", "await self.go([x for x in range(3)])"]
    assert got["comprehensions"] == ["[x for x in range(3)]"] and got["context_managers"] == ["with open(path) as f:"]
    assert got["imports"] == ["import re", "from pathlib import Path"]
    assert got["docstrings"] == ['"""Module doc."""', '"""Reads."""']
    assert python_ast_spans("def broken(:\n") is None
    # non-ASCII before a node: ast's byte columns become character offsets
    text = 'x = "héllo"; import os\n'
    ((a, b, name),) = [s for s in python_ast_spans(text) if s[2] == "imports"]
    assert text[a:b] == "import os"


def test_token_spans_overlap_rule():
    offsets = [(0, 3), (3, 4), (4, 9), (9, 10)]  # tokens over characters 0..10
    assert token_spans(offsets, [(0, 3, "a"), (2, 5, "b"), (9, 10, "c"), (4, 4, "empty")]) == \
        [(0, 1, "a"), (0, 3, "b"), (3, 4, "c")]


def _recipe(tmp_path: Path, labels: str, sources: list[str], **data) -> Path:
    p = tmp_path / "r.yaml"
    extra = "".join(f", {k}: {json.dumps(v)}" for k, v in data.items())
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\n"
                 f"data: {{sources: {json.dumps(sources)}, labels: {labels}, val_fraction: 0.2{extra}}}\n"
                 "tokenizer: {vocab_size: 512}\n")
    return p


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("labelled")
    r = run_cli("tokenize", str(_recipe(root, "python-ast", ["builtin:python-stdlib"], max_documents=40)), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "run" / "data"


def test_tokenize_writes_spans_aligned_with_the_token_stream(labelled: Path):
    """Every span re-derived from its document's text and the tokenizer lands where the file says."""
    from tokenizers import Tokenizer

    meta = json.loads((labelled / "meta.json").read_text())
    lab = meta["labels"]
    assert lab["labeller"] == "python-ast" and lab["vocabulary"] == list(PYTHON_CONCEPTS)
    assert lab["documents_labelled"] > 30 and lab["spans"]["train"] > 100
    tok = Tokenizer.from_file(str(labelled / "tokenizer.json"))
    train = IndexedDataset(labelled / "train")
    spans = np.load(labelled / "train.labels.npy")
    assert spans.shape[1] == 3 and (np.diff(spans[:, 0]) >= 0).all()
    # the first train document by hand
    first = train[0][:-1].tolist()  # without its EOD
    text = tok.decode(first)
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids == first
    want = sorted((a, b, lab["vocabulary"].index(n)) for a, b, n in token_spans(enc.offsets, python_ast_spans(text)))
    got = [tuple(r) for r in spans.tolist() if r[1] <= len(first)]
    assert got == want and want


def test_loader_evidence_per_window(labelled: Path):
    meta = json.loads((labelled / "meta.json").read_text())
    n = len(meta["labels"]["vocabulary"])
    train = IndexedDataset(labelled / "train")
    spans = LabelSpans(labelled / "train", train.num_tokens, n)
    loader = WindowLoader(train, 64, 4, seed=0, labels=spans)
    next(loader)
    ev = loader.last_labels()
    assert ev.shape == (4, 64, n) and ev.dtype == bool and ev.any()
    arr = np.load(labelled / "train.labels.npy")
    for row, w in enumerate(loader.last_ids):
        a = int(w) * 64
        want = np.zeros((64, n), dtype=bool)
        for s, e, c in arr:
            if s < a + 64 and e > a:
                want[max(s - a, 0):min(e - a, 64), c] = True
        assert (ev[row] == want).all()


def test_field_labels_and_a_span_outside_its_document(tmp_path: Path):
    docs = [{"text": "def f():\n    return 1\n" * 5, "concepts": ["python", {"concept": "returns", "start": 13,
                                                                       "end": 21}]},
            {"text": "plain words here " * 20, "concepts": ["prose"]},
            {"text": "more plain words " * 20}]
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    r = run_cli("tokenize", str(_recipe(tmp_path, "field", [str(src)], val_fraction=0.0)), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads(r.stdout)
    assert meta["labels"]["vocabulary"] == ["python", "returns", "prose"] and meta["labels"]["documents_labelled"] == 2
    # a span past the end of its document: one error line, and the existing dataset stays as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "data").iterdir() if p.is_file()}
    docs[0]["concepts"] = [{"concept": "returns", "start": 10, "end": 10_000}]
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    r = run_cli("tokenize", str(_recipe(tmp_path, "field", [str(src)], val_fraction=0.0)))
    assert r.returncode == 2
    (err,) = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert "document 0 ('concepts'): label span 'returns' [10, 10000) falls outside the document" in err
    after = {p.name: p.read_bytes() for p in (tmp_path / "run" / "data").iterdir() if p.is_file()}
    assert after == before and not list((tmp_path / "run").glob(".data.tmp-*"))


def test_a_label_file_that_disagrees_with_the_token_stream(labelled: Path, tmp_path: Path):
    from ncpctl.errors import UserError

    train = IndexedDataset(labelled / "train")
    bad = tmp_path / "train"
    arr = np.load(labelled / "train.labels.npy").copy()
    arr[-1, 1] = train.num_tokens + 5
    np.save(f"{bad}.labels.npy", arr)
    with pytest.raises(UserError, match=r"disagrees with the token stream"):
        LabelSpans(bad, train.num_tokens, 16)
    with pytest.raises(UserError, match="has no concept labels"):
        LabelSpans(tmp_path / "none", train.num_tokens, 16)
