"""`ncpctl.model.core.config.deep_merge`: the one deep merge (model sizes, recipe `extends:`,
`deepspeed.extra`), its copy semantics and origin hook, and that nobody keeps a second one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import ncpctl.recipe.load
import ncpctl.train.zero
from ncpctl.model.core import config as model_config
from ncpctl.model.core.config import SIZES, build_config, deep_merge

PKG = Path(model_config.__file__).resolve().parents[2]  # ncpctl/ (config.py is model/core/config.py)


def test_merges_nested_dicts_and_over_wins() -> None:
    base = {"a": 1, "b": {"x": 1, "y": {"p": 1}}, "c": [1, 2], "d": 5}
    over = {"b": {"y": {"q": 2}, "z": 3}, "c": [3], "d": {"now": "a dict"}, "e": None}
    assert deep_merge(base, over) == {"a": 1, "b": {"x": 1, "y": {"p": 1, "q": 2}, "z": 3}, "c": [3],
                                      "d": {"now": "a dict"}, "e": None}
    assert deep_merge({"k": {"x": 1}}, {"k": 7}) == {"k": 7}  # a value replaces a section


def test_result_shares_nothing_with_its_inputs() -> None:
    base = {"s": {"list": [1], "deep": {"v": 1}}}
    over = {"s": {"new": {"w": [2]}}, "top": [3]}
    out = deep_merge(base, over)
    out["s"]["list"].append(9)
    out["s"]["deep"]["v"] = 9
    out["s"]["new"]["w"].append(9)
    out["top"].append(9)
    assert base == {"s": {"list": [1], "deep": {"v": 1}}}
    assert over == {"s": {"new": {"w": [2]}}, "top": [3]}
    # build_config hands the merged dict on: the named sizes stay as declared
    before = repr(SIZES["debug"])
    cfg = build_config("debug", concept={"k": 8, "enabled": True})
    assert cfg.concept.k == 8 and repr(SIZES["debug"]) == before and SIZES["debug"]["concept"]["k"] == 4


def test_on_leaf_sees_every_value_taken_from_over() -> None:
    seen: list[tuple[tuple, object]] = []
    deep_merge({"a": {"x": 1}, "b": 1}, {"a": {"y": 2, "x": 3}, "b": {"new": 1}, "c": 4},
               on_leaf=lambda key, v: seen.append((key, v)))
    assert seen == [(("a", "y"), 2), (("a", "x"), 3), (("b",), {"new": 1}), (("c",), 4)]


def test_one_merge_everywhere() -> None:
    """recipe/load.py and train/zero.py use this function and define no merge of their own."""
    assert ncpctl.recipe.load.deep_merge is deep_merge
    assert ncpctl.train.zero.deep_merge is deep_merge
    for rel in ("recipe/load.py", "train/zero.py", "model/core/config.py"):
        tree = ast.parse((PKG / rel).read_text())
        merges = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and "merge" in n.name.lower()]
        assert merges == (["deep_merge", "merge_into"] if rel == "model/core/config.py" else []), (rel, merges)


def test_model_config_imports_only_the_standard_library() -> None:
    """The config modules are copied into exported HF directories and must import without
    torch (``ncpctl --help`` stays fast): config.py and every module it reaches by module-level
    imports of the model package (the design sections, the registry, and the designs' records the
    registry loads by import path, ``DESIGNS``) import only the standard library and each other at
    module level (issue 44: absolute ``from ncpctl.model.x.y import``, made flat by the export)."""
    from ncpctl.model.registry import DESIGNS

    todo, seen = ["core.config"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = PKG / "model" / Path(*name.split("."))
        top = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()).body
        names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
                  and not n.module.startswith("ncpctl.model.")}
        assert names <= set(sys.stdlib_module_names) | {"__future__"}, (name, names)
        assert not [n for n in top if isinstance(n, ast.ImportFrom) and n.level], name  # the package's own: absolute
        todo += [n.module.removeprefix("ncpctl.model.") for n in top
                 if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("ncpctl.model.")]
        if name == "registry":
            todo += [t.partition(":")[0][1:] for t in DESIGNS]
    assert {"core.config", "core.config_base", "registry", "designs.dynamic.config", "designs.dynamic.spec"} <= seen