"""The 8B recipes are set up for a real cluster run (issue 27): each trains on a ``data.mix`` (one
component where the paper names one corpus or gives no weights) and checkpoints activations, which
at their sequence lengths dominate an 80 GB GPU (docs/training.md, "How much it saves at 8B")."""
from __future__ import annotations

from pathlib import Path

import pytest

from ncpctl.recipe.load import _load_tree

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
EIGHT_B = ["llama3.1-8b-conceptlm", "llama3.1-8b-conceptlm-detach", "llama3.1-8b-pm", "llama3.1-8b-trained",
           "ncp-archpreview-8.9b", "ncp-archpreview-8.9b-stage2", "steerling-8b", "steerling-8b-midtrain"]


@pytest.mark.parametrize("name", EIGHT_B)
def test_8b_recipe_uses_a_mixture_and_activation_checkpointing(name: str) -> None:
    problems: list[str] = []
    tree = _load_tree(RECIPES / f"{name}.yaml", problems, {})
    assert problems == []
    data, train = tree["data"], tree["train"]
    assert data.get("train_prefix") is None, "a data.train_prefix would replace the mixture"
    mix = data["mix"]
    assert mix and all(m["weight"] > 0 and m["name"] and m["prefix"] and m["val_prefix"] for m in mix)
    assert sum(m["weight"] for m in mix) == pytest.approx(1.0)
    assert train["activation_checkpointing"] in ("selective", "full")
