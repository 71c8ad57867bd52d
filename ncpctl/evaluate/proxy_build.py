"""Build a capability-proxy set from installed packages: ``python -m ncpctl.evaluate.proxy_build``.

Docstring-to-function pairs from the ``.py`` files of packages a model never trained on (the
defaults, networkx and mpmath, are the packages the replication recipes hold out with
``builtin:python-packages:exclude=networkx+mpmath``; the debug recipes train on the standard
library only). The files are the ``builtin:python-packages:include=...`` selection, so the
same test-folder, vendored-tree and duplicate rules apply as in training. Each package is a source:

* capability ``function generation``: prompt = a top-level function's header and docstring, suffix =
  its body (the expert continuation);
* capability ``function choice``: the same prompt with ``choices`` = the true body and three bodies
  of other functions of the same package (``label`` = the true one's index), for the margin metric.

Functions with a docstring and a body of 2-30 lines (each part at most 800 characters), in document order, every ``stride``-th one up
to ``per_source`` per package and capability. Deterministic for a given installed version.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

from ncpctl.corpora.packages import listing

DEFAULT_PACKAGES = ("networkx", "mpmath")
MAX_CHARS = 800  # prompt and body each


def _pairs(text: str) -> list[tuple[str, str]]:
    """(header + docstring, body) of each documented top-level function of one file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc, end = node.body[0], node.end_lineno or node.lineno
        if len(node.body) < 2 or not 2 <= end - doc.end_lineno <= 30:
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        prompt, body = "".join(lines[start:doc.end_lineno]), "".join(lines[doc.end_lineno:end]).rstrip() + "\n"
        if body.strip() and len(prompt) <= MAX_CHARS and len(body) <= MAX_CHARS:  # fits a small model's window
            out.append((prompt, body))
    return out


def build(packages: tuple[str, ...] = DEFAULT_PACKAGES, per_source: int = 12, stride: int = 5,
          seed: int = 0) -> list[dict]:
    sel = listing("builtin:python-packages:include=" + "+".join(packages))
    by_pkg: dict[str, list[tuple[str, str]]] = {}
    for f in sel.files:
        by_pkg.setdefault(f.package, []).extend(_pairs(f.path.read_text(encoding="utf-8", errors="replace")))
    rng = random.Random(seed)
    items = []
    for pkg, pairs in sorted(by_pkg.items()):
        picked = pairs[::stride][: 2 * per_source]
        for i, (prompt, body) in enumerate(picked):
            if i < per_source:
                items.append({"prompt": prompt, "suffix": body, "source": pkg, "capability": "function generation"})
                continue
            others = rng.sample([b for _, b in pairs if b != body], 3)
            label = rng.randrange(4)
            choices = others[:label] + [body] + others[label:]
            items.append({"prompt": prompt, "suffix": body, "source": pkg, "capability": "function choice",
                          "choices": choices, "label": label})
    return items


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", default="+".join(DEFAULT_PACKAGES), help="A+B: installed packages (the sources)")
    ap.add_argument("--per-source", type=int, default=12)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    items = build(tuple(a.packages.split("+")), a.per_source)
    Path(a.out).write_text("".join(json.dumps(it) + "\n" for it in items))
    print(f"{a.out}: {len(items)} items")


if __name__ == "__main__":
    main()
