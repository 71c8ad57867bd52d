"""docs/recipes.md is generated from the schema (every field documented once) and current."""

from __future__ import annotations

from ncpctl.recipe.reference import render
from ncpctl.recipe.schema import SECTIONS

from ..conftest import REPO


def test_reference_is_current() -> None:
    shipped = (REPO / "docs" / "recipes.md").read_text()
    assert shipped == render(), "docs/recipes.md is stale: run python -m ncpctl.recipe.reference"


def test_every_key_is_documented() -> None:
    text = render()
    undocumented = [line for line in text.splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert undocumented == []
    for section in SECTIONS:
        assert f"## `{section}`" in text
    assert "| `model.concept.segments` |" in text and "| `train.max_steps` |" in text


def test_an_optional_literal_keeps_its_closing_bracket() -> None:
    """Issue 28: docs/recipes.md printed `model.qk_norm`'s type as ``Literal['none', 'layer', 'head'``
    (every trailing bracket stripped with Optional's)."""
    from typing import Literal, Optional

    from ncpctl.recipe.reference import _type_name, render

    assert _type_name(Optional[Literal["none", "layer", "head"]]) == "Literal['none', 'layer', 'head']"
    assert _type_name(Optional[int]) == "int"
    types = [line.split(" | ")[1] for line in render().splitlines() if line.startswith("| `")]
    assert len(types) > 100 and all(t.count("[") == t.count("]") and "FieldInfo" not in t for t in types)
