"""The ZeRO stage has one owner (``ncpctl.train.zero.Zero``, issue 44 item 5): outside it (and the
recipe that declares and validates the key) no module reads ``deepspeed.zero_stage`` from a recipe
or compares a stage with a number; they ask ``Zero`` (partitioned, wraps_optimizer, ...)."""

from __future__ import annotations

import ast

from ncpctl.train.zero import Zero

from ..conftest import REPO

PACKAGE = REPO / "ncpctl"
OWNERS = {"ncpctl/train/zero.py", "ncpctl/recipe/schema.py", "ncpctl/recipe/load.py"}


def _is_stage(node: ast.AST) -> bool:
    """``x.zero_stage``, ``zero_stage`` or ``meta["zero_stage"]``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "zero_stage"
    if isinstance(node, ast.Name):
        return node.id == "zero_stage"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "zero_stage"


def stage_uses(source: str) -> list[str]:
    """The recipe reads (``.deepspeed.zero_stage``) and the comparisons of a stage with a number."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr == "zero_stage" and isinstance(n.value, ast.Attribute) \
                and n.value.attr == "deepspeed":
            found.append(f"line {n.lineno}: reads deepspeed.zero_stage")
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(_is_stage(s) for s in sides) and any(isinstance(s, ast.Constant) for s in sides):
                found.append(f"line {n.lineno}: compares a ZeRO stage with a number")
    return found


def test_only_zero_reads_and_branches_on_the_stage() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    texts = {str(p.relative_to(REPO)): p.read_text() for p in files}
    bad = [f"{rel}: {u}" for rel, text in texts.items() if rel not in OWNERS and "zero_stage" in text
           for u in stage_uses(text)]
    assert not bad, "ask ncpctl.train.zero.Zero instead: " + "; ".join(bad)
    # the check sees both forms
    assert sorted(stage_uses("if recipe.deepspeed.zero_stage == 3: pass")) == [
        "line 1: compares a ZeRO stage with a number", "line 1: reads deepspeed.zero_stage"]
    assert stage_uses("x = meta['zero_stage'] <= 2") == ["line 1: compares a ZeRO stage with a number"]


def test_what_each_stage_means() -> None:
    assert [Zero(s).partitioned for s in range(4)] == [False, False, False, True]
    assert [Zero(s).wraps_optimizer for s in range(4)] == [False, True, True, True]
    assert [Zero(s).flat_optimizer_state for s in range(4)] == [True, True, True, False]
    assert [Zero(s).bf16_optimizer for s in range(4)] == [False, True, False, False]
    assert not Zero(1, offload=True).bf16_optimizer
    assert Zero(2, offload=True).config(on_gpu=True) == {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                             "pin_memory": True}}
    assert str(Zero(3)) == "ZeRO-3"
