"""What the engine set-up refuses before DeepSpeed fails inside it with an internal error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ncpctl.errors import UserError
from ncpctl.model.core.model import NCPModel
from ncpctl.recipe import load_recipe
from ncpctl.train.engine import Dist, build_engine
from tests.conftest import RECIPES


def test_a_parameter_without_dimensions_is_refused_by_name():
    """A design's learned scalar (nn.Parameter(torch.tensor(1.0))) made DeepSpeed's model broadcast
    fail with 'self.dim() cannot be 0 to view Float as Byte' (an internal error); now a one-line
    error names the parameter and the fix, before the engine is built."""
    recipe = load_recipe(RECIPES / "debug.yaml", ["model.max_seq_len=64", "train.seq_len=32"])
    model = NCPModel(recipe.model_config)
    model.decoder.register_parameter("gate", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(UserError, match=r"model parameter decoder\.gate has no dimensions") as e:
        build_engine(recipe, model, Dist(0, 1, 0, torch.device("cpu")))
    assert "shape (1,)" in str(e.value.hint)
