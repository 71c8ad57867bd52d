"""The loop calls design hooks and names no design (issue 22 item 3): what a design adds to a run
lives in its own hooks module (``ncpctl.train.designs``); a registered design's hooks are called
like the built-in ones."""

from __future__ import annotations

import ast
from typing import Any

import torch

from ncpctl.recipe import load_recipe
from ncpctl.train import hooks as H

from ..conftest import REPO

LOOP = REPO / "ncpctl" / "train" / "loop.py"
# the loop's set-up and its callbacks (issue 44 item 5): moved out of loop.py, held to the same rule
LOOP_PARTS = [REPO / "ncpctl" / "train" / f"{name}.py" for name in ("prepare", "callbacks", "faults")]
# what the shipped designs are called, and the things only one of them has
DESIGN_WORDS = ("bottleneck", "concept", "codebook", "code_", "dlcm", "dynamic", "segment", "label", "lift",
                "steer", "mtp", "source_counts", "tokens_per_concept", "detection", "auc")


def _code_words(tree: ast.AST) -> list[str]:
    """Every identifier, attribute, keyword and string of the code (docstrings and comments aside)."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.append(n.id)
        elif isinstance(n, ast.Attribute):
            words.append(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            words.append(n.name)
        elif isinstance(n, ast.arg):
            words.append(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            words.append(n.arg)
        elif isinstance(n, ast.alias):
            words.append(n.asname or n.name)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            words.append(n.value)
    return words


def test_the_loop_names_no_design() -> None:
    tree = ast.parse(LOOP.read_text())
    named = sorted({w for w in _code_words(tree) if any(d in w.lower() for d in DESIGN_WORDS)})
    assert not named, f"ncpctl/train/loop.py names designs: {named}"
    assert len(LOOP.read_text().splitlines()) <= 600
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"functions over 80 lines in the loop: {long}"


def test_the_loops_set_up_and_callbacks_name_no_design() -> None:
    for path in LOOP_PARTS:
        named = sorted({w for w in _code_words(ast.parse(path.read_text())) if any(d in w.lower() for d in DESIGN_WORDS)})
        assert not named, f"{path.relative_to(REPO)} names designs: {named}"


class _Loader:
    """What a hook reads of a loader: the rows of the last batch."""

    def __init__(self, rows: int):
        self.rows = rows


class _Dist:
    world, rank, device = 1, 0, torch.device("cpu")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.double()


def test_registered_designs_are_called_at_each_point(monkeypatch) -> None:
    """Plugins' hooks (``register_hooks``) run after the built-in ones, in order: their forward
    inputs are merged per micro-batch (tensors moved to the device), their validation keys,
    checkpoint keys and plot arguments joined; a design whose ``applies`` is false is never built."""
    seen: list[Any] = []

    class Rows(H.DesignHooks):
        @classmethod
        def applies(cls, recipe) -> bool:
            return recipe.train.seed == 7

        def inputs(self, loader, micro, evaluating):
            return [{"row_ids": r, "evaluating": evaluating} for r in torch.arange(loader.rows).split(micro)]

        def eval_micro(self, i, out):
            seen.append((i, out))

        def eval_end(self, d):
            return {"rows/seen": float(d.sum(torch.tensor([len(seen)])).item())}

        def checkpoint_meta(self):
            return {"rows": 1}

    class Flag(Rows):
        def inputs(self, loader, micro, evaluating):
            return None if not evaluating else [{"flag": True}] * 2

        def plots(self):
            return {"target_ratio": 4.0}

    class Absent(H.DesignHooks):
        def __init__(self, recipe):
            raise AssertionError("built although it does not apply")

    monkeypatch.setattr(H, "_registered", [])
    for cls in (Rows, Absent, Flag):
        assert H.register_hooks(cls) is cls
    r = load_recipe(REPO / "recipes" / "debug.yaml", ["train.seed=7", "train.plots=false"])
    hooks = H.Hooks(r)
    assert [type(h) for h in hooks.each] == [Rows, Flag]  # no built-in design in debug.yaml applies
    kw = hooks.inputs(_Loader(4), 2, 2, torch.device("cpu"), evaluating=True)
    assert kw == [{"row_ids": kw[0]["row_ids"], "evaluating": True, "flag": True},
                  {"row_ids": kw[1]["row_ids"], "evaluating": True, "flag": True}]
    assert kw[1]["row_ids"].tolist() == [2, 3]
    assert hooks.inputs(_Loader(4), 2, 2, torch.device("cpu"))[0].keys() == {"row_ids", "evaluating"}
    hooks.eval_begin(torch.nn.Linear(1, 1), final=False)
    hooks.eval_micro(0, "out0")
    assert seen == [(0, "out0"), (0, "out0")]  # both designs saw it
    assert hooks.eval_end(_Dist()) == {"rows/seen": 2.0}
    assert hooks.checkpoint_meta() == {"rows": 1} and hooks.plots() == {"target_ratio": 4.0}
