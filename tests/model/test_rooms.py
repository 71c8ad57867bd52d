"""Issue 44 item 2: the model package's rooms import each other without a circle. Every import of a
model module by another (module level or inside a function) is an arrow; no module reaches itself
by following them (the bottleneck's three files, the diffusion objective and its ELBO, the families
and the layers once did)."""

from __future__ import annotations

import ast
from pathlib import Path

import ncpctl.model

MODEL = Path(ncpctl.model.__file__).parent


def arrows(model: Path = MODEL) -> dict[str, set[str]]:
    """Model module (dotted, below ncpctl.model) -> the model modules it imports."""
    mods = {}
    for p in model.rglob("*.py"):
        name = ".".join(p.relative_to(model).with_suffix("").parts)
        mods[name.removesuffix(".__init__").removesuffix("__init__")] = p
    out: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("ncpctl.model."):
                target = n.module.removeprefix("ncpctl.model.")
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != m:
                    out[m].add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_rooms_import_without_a_circle():
    graph = arrows()
    assert {"core.model", "designs.bottleneck.module", "designs.bottleneck.chunks", "families.base"} <= set(graph)
    assert not circles(graph), circles(graph)


def test_the_circle_check_sees_one():
    graph = arrows()
    graph["designs.bottleneck.chunks"] = graph["designs.bottleneck.chunks"] | {"designs.bottleneck.module"}
    assert ["designs.bottleneck.chunks", "designs.bottleneck.module"] in circles(graph)


def test_the_rooms_import_each_other_by_absolute_paths():
    """Every import between model modules is ``from ncpctl.model.x.y import`` (the export flattens
    those; ``arrows`` reads those): none is relative."""
    relative = [f"{p.relative_to(MODEL)}:{n.lineno}" for p in MODEL.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative
