"""Style rule 15: functions fit on a screen. Nothing in ``ncpctl/`` is over 120 lines, and the
training loop (``ncpctl.train.loop.train``) reads top to bottom in at most 80."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ncpctl"
MAX_LINES, MAX_LOOP_LINES = 120, 80


def _functions() -> list[tuple[str, str, int]]:
    """(file, qualified name, lines from ``def`` to the last line) of every function, nested too."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    found.append((rel, name, child.end_lineno - child.lineno + 1))
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_function_is_longer_than_120_lines() -> None:
    functions = _functions()
    assert len(functions) > 100  # the walk found the package
    long = [f"{rel}::{name} ({n} lines)" for rel, name, n in functions if n > MAX_LINES]
    assert not long, "functions over 120 lines (style rule 15): " + ", ".join(long)


def test_the_training_loop_reads_on_a_screen() -> None:
    (n,) = [n for rel, name, n in _functions() if rel == "ncpctl/train/loop.py" and name == "train"]
    assert n <= MAX_LOOP_LINES, f"ncpctl/train/loop.py::train is {n} lines (at most {MAX_LOOP_LINES})"


def test_no_module_is_longer_than_600_lines() -> None:
    """Issue 22: a module that outgrows 600 lines is split by what it is about."""
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50
    long = [f"{rel} ({n} lines)" for rel, n in sorted(sizes.items()) if n > 600]
    assert not long, "modules over 600 lines: " + ", ".join(long)
