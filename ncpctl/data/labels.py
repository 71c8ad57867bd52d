"""Concept labels as data (``data.labels``; Steerling's labelled concepts, issue: the bottleneck).

``tokenize`` writes, next to each split's ``PREFIX.bin/.idx``, ``PREFIX.labels.npy``: an int64
array (K, 3) of token spans ``[start, end, label]`` (start inclusive, end exclusive, positions in
the split's flat token stream, sorted by start), and the label vocabulary in ``meta.json``
(``labels.vocabulary``: label id -> name). A token carries a label when it lies in one of that
label's spans; a chunk's label is the OR over its tokens (the bottleneck derives both).

Two labellers:

* ``field``: each JSON record's ``data.labels_field`` (default ``concepts``): a list whose items
  are a name (a document label: the whole document) or ``{"concept": NAME, "start": a, "end": b}``
  (a span by character offsets into the record's text, end exclusive). Names get ids in the
  order first seen. A span outside its document is an error naming the record. The concepts given
  as document labels (a name, or a span over the whole text) are listed in
  ``labels.document_level``: they sit on every token of their document, so they are targets
  only (training refuses to teacher-force with them: no position could be fed them without
  seeing its document's future).
* ``python-ast``: the built-in labeller for Python sources (``builtin:python-stdlib`` and any
  ``.py`` text): ``ast`` nodes give human-readable concepts (``PYTHON_CONCEPTS``) with their
  source positions as spans: the header line of a compound statement (``class X(...):``,
  ``try:``, ``except E:``, ``async def``, ``with``), the whole node for expressions and simple
  statements. A document that does not parse gets no labels (counted as ``unparsed``).

Character spans become token spans through the tokenizer's offsets (a token belongs to a span
when their character ranges overlap). The labels pass re-reads the corpus in the order the
token pass wrote it and checks every document's token count against the ``.idx`` it wrote, so
the spans cannot drift from the tokens.
"""

from __future__ import annotations

import ast
import bisect
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.sources import ReadStats, documents
from ncpctl.errors import UserError

SUFFIX = ".labels.npy"
LABELLERS = ("none", "python-ast", "field")

# name -> what it marks (the python-ast labeller's vocabulary, in id order)
PYTHON_CONCEPTS: dict[str, str] = {
    "class_definition": "a class statement's header",
    "function_definition": "a def statement's header (sync or async)",
    "async_code": "async def / await / async for / async with",
    "exception_handling": "try / except / finally headers and raise statements",
    "regular_expressions": "calls into the re module",
    "file_io": "open(...), read/write calls on files and Path read/write calls",
    "decorators": "decorator lines",
    "type_hints": "argument, return and variable annotations",
    "string_formatting": "f-strings, str.format and %-formatting of a string literal",
    "tests": "test functions, assert statements and unittest assert calls",
    "comprehensions": "list / set / dict comprehensions and generator expressions",
    "imports": "import statements",
    "loops": "for / while headers",
    "context_managers": "with statement headers",
    "lambdas": "lambda expressions",
    "docstrings": "a module, class or function docstring",
}
_FILE_CALLS = {"open", "read", "write", "readline", "readlines", "writelines", "read_text", "write_text", "read_bytes",
               "write_bytes"}


def labels_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


# ----------------------------------------------------------------------------- python-ast


class _Positions:
    """ast (line, UTF-8 byte column) -> character offset in the text."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def char(self, line: int, col: int) -> int:
        if line - 1 >= len(self.lines):
            return self.starts[-1]
        raw = self.lines[line - 1].encode("utf-8")
        return self.starts[line - 1] + len(raw[:col].decode("utf-8", errors="ignore"))

    def line_end(self, line: int) -> int:
        """The offset of the end of ``line`` (before its newline)."""
        if line - 1 >= len(self.lines):
            return self.starts[-1]
        return self.starts[line - 1] + len(self.lines[line - 1].rstrip("\r\n"))


def _header(node: ast.AST, pos: _Positions) -> tuple[int, int]:
    return pos.char(node.lineno, node.col_offset), pos.line_end(node.lineno)


def _whole(node: ast.AST, pos: _Positions) -> tuple[int, int]:
    return pos.char(node.lineno, node.col_offset), pos.char(node.end_lineno, node.end_col_offset)


def _call_name(node: ast.Call) -> tuple[str | None, str | None]:
    """(module-ish owner, attribute or function name) of a call."""
    f = node.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        return owner, f.attr
    return None, None


def python_ast_spans(text: str) -> list[tuple[int, int, str]] | None:
    """Character spans (start, end, concept) of ``PYTHON_CONCEPTS`` in Python source; None when
    the text does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    pos = _Positions(text)
    out: list[tuple[int, int, str]] = []

    def add(span: tuple[int, int], name: str) -> None:
        if span[1] > span[0]:
            out.append((span[0], span[1], name))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                add(_whole(body[0], pos), "docstrings")
        if isinstance(node, ast.ClassDef):
            add(_header(node, pos), "class_definition")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(_header(node, pos), "function_definition")
            if isinstance(node, ast.AsyncFunctionDef):
                add(_header(node, pos), "async_code")
            if node.name.startswith("test"):
                add(_header(node, pos), "tests")
            if node.returns is not None:
                add(_whole(node.returns, pos), "type_hints")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                add(_whole(dec, pos), "decorators")
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            add(_header(node, pos) if isinstance(node, (ast.AsyncFor, ast.AsyncWith)) else _whole(node, pos),
                "async_code")
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            add(_header(node, pos), "exception_handling")
        elif isinstance(node, ast.ExceptHandler):
            add(_header(node, pos), "exception_handling")
        elif isinstance(node, ast.Raise):
            add(_whole(node, pos), "exception_handling")
        elif isinstance(node, ast.Call):
            owner, name = _call_name(node)
            if owner == "re":
                add(_whole(node, pos), "regular_expressions")
            if name in _FILE_CALLS:
                add(_whole(node, pos), "file_io")
            if name == "format" and isinstance(getattr(node.func, "value", None), ast.Constant):
                add(_whole(node, pos), "string_formatting")
            if name and name.startswith("assert") and owner == "self":
                add(_whole(node, pos), "tests")
        elif isinstance(node, ast.arg) and node.annotation is not None:
            add(_whole(node.annotation, pos), "type_hints")
        elif isinstance(node, ast.AnnAssign):
            add(_whole(node.annotation, pos), "type_hints")
        elif isinstance(node, ast.JoinedStr):
            add(_whole(node, pos), "string_formatting")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str):
            add(_whole(node, pos), "string_formatting")
        elif isinstance(node, ast.Assert):
            add(_whole(node, pos), "tests")
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            add(_whole(node, pos), "comprehensions")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            add(_whole(node, pos), "imports")
        elif isinstance(node, (ast.For, ast.While)):
            add(_header(node, pos), "loops")
        elif isinstance(node, ast.With):
            add(_header(node, pos), "context_managers")
        elif isinstance(node, ast.Lambda):
            add(_whole(node, pos), "lambdas")
    out.sort()
    return out


# ----------------------------------------------------------------------------- field labels


def field_spans(raw: Any, text: str, where: str) -> list[tuple[int, int, str]]:
    """A record's labels (see the module doc) as character spans; a UserError naming ``where``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise UserError(f"{where}: labels must be a list of names or {{concept, start, end}} spans, "
                        f"got {type(raw).__name__}")
    out = []
    for item in raw:
        if isinstance(item, str) and item:
            out.append((0, len(text), item))
            continue
        if not (isinstance(item, dict) and isinstance(item.get("concept"), str) and item["concept"]):
            raise UserError(f"{where}: label {item!r} is neither a name nor a {{concept, start, end}} span")
        a, b = item.get("start", 0), item.get("end", len(text))
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= len(text)):
            raise UserError(f"{where}: label span {item['concept']!r} [{a}, {b}) falls outside the document "
                            f"(characters 0..{len(text)}) or is empty")
        out.append((a, b, item["concept"]))
    return out


# ----------------------------------------------------------------------------- to tokens


def token_spans(offsets: list[tuple[int, int]], spans: Iterable[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Character spans -> token spans [ta, tb) of the tokens whose character range overlaps."""
    ends = [e for _, e in offsets]
    starts = [s for s, _ in offsets]
    out = []
    for a, b, name in spans:
        ta = bisect.bisect_right(ends, a)  # first token ending after a
        tb = bisect.bisect_left(starts, b)  # tokens starting before b
        if tb > ta:
            out.append((ta, tb, name))
    return out


def labelled_documents(recipe, stats) -> Iterator[tuple[np.ndarray, list[str], list[Any]]]:
    """(document indices, texts, raw labels) in the token pass's order (``sources.documents``,
    the same reader and filters); raw labels are None for python-ast."""
    d = recipe.data
    if d.labels == "field":
        yield from documents(recipe.data, stats, extra_field=d.labels_field)
        return
    for idx, texts in documents(recipe.data, stats):
        yield idx, texts, [None] * len(texts)


def write_labels(recipe, out: Path, split, log) -> dict[str, Any]:
    """The labels pass (after the token pass wrote ``out``): ``{split}.labels.npy`` per split and
    the ``labels`` entry of meta.json."""
    from tokenizers import Tokenizer

    d = recipe.data
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sizes = {s: np.asarray(IndexedDataset(out / s).sizes) for s in ("train", "val")}
    cursor = {s: 0 for s in sizes}  # documents of each split seen
    offset = {s: 0 for s in sizes}  # tokens of each split before the current document
    rows: dict[str, list[tuple[int, int, int]]] = {s: [] for s in sizes}
    vocab: dict[str, int] = {n: i for i, n in enumerate(PYTHON_CONCEPTS)} if d.labels == "python-ast" else {}
    unparsed = labelled = 0
    document_level: set[str] = set()  # concepts given as a name: the whole document
    log(f"labelling concepts ({d.labels})")
    for idx, texts, raws in labelled_documents(recipe, ReadStats()):
        encs = tok.encode_batch(texts, add_special_tokens=False)
        for i, text, raw, enc, val in zip(idx, texts, raws, encs, split.is_val(idx)):
            s = "val" if val else "train"
            n = len(enc.ids) + 1  # + the end-of-document token
            k = cursor[s]
            if k >= sizes[s].size or int(sizes[s][k]) != n:
                raise UserError(f"data.labels: document {int(i)} re-encodes to {n} tokens but the {s} split holds "
                                f"{int(sizes[s][k]) if k < sizes[s].size else 'no'} for it: the labels would "
                                f"disagree with the token stream (is the corpus changing while it is read?)")
            if d.labels == "python-ast":
                spans = python_ast_spans(text)
                unparsed += spans is None
                spans = spans or []
            else:
                spans = field_spans(raw, text, f"document {int(i)} ({d.labels_field!r})")
                document_level.update(name for a, b, name in spans if (a, b) == (0, len(text)))  # every token
            for ta, tb, name in token_spans(enc.offsets, spans):
                rows[s].append((offset[s] + ta, offset[s] + tb, vocab.setdefault(name, len(vocab))))
            labelled += bool(spans)
            cursor[s] += 1
            offset[s] += n
    counts = {}
    for s, r in rows.items():
        arr = np.asarray(sorted(r), dtype=np.int64).reshape(-1, 3)
        np.save(out / f"{s}{SUFFIX}", arr)
        counts[s] = int(arr.shape[0])
    if not vocab:
        raise UserError(f"data.labels: {d.labels}: no document has a label")
    return {"labeller": d.labels, "field": d.labels_field if d.labels == "field" else None,
            "vocabulary": list(vocab), "document_level": [n for n in vocab if n in document_level],
            "spans": counts, "documents_labelled": labelled, "unparsed": unparsed}


# ----------------------------------------------------------------------------- reading


class LabelSpans:
    """``PREFIX.labels.npy`` of a dataset of ``num_tokens`` tokens and ``n`` labels, validated on
    open; ``window(a, T)`` is the (T, n) bool evidence of tokens a .. a+T-1."""

    def __init__(self, prefix: str | Path, num_tokens: int, n: int):
        path = labels_path(prefix)
        if not path.is_file():
            raise UserError(f"{path}: file not found (the dataset has no concept labels: set data.labels and "
                            f"run `ncpctl tokenize` again)")
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise UserError(f"{path}: not a label file ({e})") from None
        if arr.ndim != 2 or arr.shape[1] != 3 or arr.dtype != np.int64:
            raise UserError(f"{path}: expected (K, 3) int64 token spans, got {arr.shape} {arr.dtype}")
        if arr.size:
            bad = (arr[:, 0] < 0) | (arr[:, 1] <= arr[:, 0]) | (arr[:, 1] > num_tokens) | (arr[:, 2] < 0) \
                  | (arr[:, 2] >= n)
            if bad.any():
                r = arr[int(np.flatnonzero(bad)[0])]
                raise UserError(f"{path}: span [{r[0]}, {r[1]}) label {r[2]} disagrees with the token stream "
                                f"({num_tokens} tokens) or the {n}-label vocabulary")
            if (np.diff(arr[:, 0]) < 0).any():
                raise UserError(f"{path}: spans are not sorted by their start token")
        self.spans, self.n = arr, n
        self.max_len = int((arr[:, 1] - arr[:, 0]).max()) if arr.size else 0

    def window(self, a: int, T: int) -> np.ndarray:
        out = np.zeros((T, self.n), dtype=bool)
        if not self.spans.size:
            return out
        starts = self.spans[:, 0]
        lo, hi = (int(x) for x in np.searchsorted(starts, [a - self.max_len, a + T], side="left"))
        for s, e, c in np.asarray(self.spans[lo:hi]):
            if e > a:
                out[max(s - a, 0) : min(e - a, T), c] = True
        return out


def lift_tokens(streams: list[tuple[np.ndarray, LabelSpans]], count: int, vocab: int, *, min_count: int = 5,
                max_tokens: int = 4_000_000) -> np.ndarray:
    """A steering stage's lift tokens T_c (Steerling's L_express) of ``streams``, (tokens, LabelSpans)
    pairs: per labelled concept, the ``count`` token ids most over-represented inside its spans,
    (n, count) int64, -1 where a concept has fewer.

    Over-representation is the smoothed log ratio log((a_y + 1) / (A + V)) - log((b_y + 1) / (N + V))
    of a token's count a_y among concept c's span tokens (A of them) against its count b_y in the
    stream (N), among tokens seen at least ``min_count`` times in c's spans. At most ``max_tokens``
    tokens are read per concept (spans in stream order) and for the stream (its start), so this
    is one linear pass, deterministic for a dataset. Several streams (a ``data.mix``'s labelled
    components, sharing one label vocabulary) add their counts, each read up to those limits."""
    n = streams[0][1].n
    b = np.zeros(vocab, dtype=np.float64)
    inside: list[list[np.ndarray]] = [[] for _ in range(n)]  # concept c's span tokens, every stream
    for tokens, spans in streams:
        stream = np.asarray(tokens[:max_tokens]).astype(np.int64)
        b += np.bincount(stream, minlength=vocab)[:vocab]
        taken = np.zeros(n, dtype=np.int64)
        for s, e, c in np.asarray(spans.spans):
            if taken[c] < max_tokens:
                inside[c].append(np.asarray(tokens[s:e]))
                taken[c] += e - s
    out = np.full((n, count), -1, dtype=np.int64)
    for c in range(n):
        if not inside[c]:
            continue
        a = np.bincount(np.concatenate(inside[c]).astype(np.int64), minlength=vocab)[:vocab].astype(np.float64)
        score = np.log((a + 1) / (a.sum() + vocab)) - np.log((b + 1) / (b.sum() + vocab))
        score[a < min_count] = -np.inf
        top = np.argsort(-score, kind="stable")[:count]
        top = top[np.isfinite(score[top])]
        out[c, : len(top)] = top
    return out
