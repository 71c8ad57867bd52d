"""A design declares its own recipe keys through the public API only (tests/model/toy_options.py:
a depth mixer with the key ``scale``; no file under ncpctl/ knows it): the key is accepted in a
recipe and reaches the module, a bad value or an unknown key is a one-line problem naming it
(exit 2 through the real CLI), it round-trips through ``to_dict``/``from_dict`` (what a
checkpoint stores) and the recipe reference lists it."""

from __future__ import annotations

import pytest

from ncpctl.model import ConfigError, ModelConfig, build_config, register, unregister

from .toy_options import ScaledOptions, ScaledResidual


@pytest.fixture
def scaled():
    """The toy registered as ``scaled_toy`` for one test (the shipped docs/recipes.md, checked by
    tests/recipe/test_reference.py, documents the built-in designs only)."""
    register("residual", "scaled_toy", ScaledResidual)
    yield "scaled_toy"
    unregister("residual", "scaled_toy")


def test_a_registered_key_is_read_from_a_recipe_and_reaches_the_module(scaled, tmp_path) -> None:
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe.load import load_recipe

    (tmp_path / "r.yaml").write_text(f"model:\n  size: debug\n  residual: {scaled}\n"
                                     f"  options:\n    {scaled}:\n      scale: 0.5\n")
    cfg = load_recipe(tmp_path / "r.yaml").model_config
    assert cfg.design_options("residual") == ScaledOptions(scale=0.5)
    model = NCPModel(cfg)
    assert model.encoder.residual.scale == model.decoder.residual.scale == 0.5
    # --set reaches it as any other key; not given: the design's default, recorded in the config
    assert load_recipe(tmp_path / "r.yaml", [f"model.options.{scaled}.scale=2.0"]).model_config.options[scaled].scale == 2.0
    assert build_config("debug", residual=scaled).to_dict()["options"] == {scaled: {"scale": 1.0}}


def test_a_registered_key_round_trips_like_a_checkpoint(scaled) -> None:
    cfg = build_config("debug", residual=scaled, options={scaled: {"scale": 0.25}})
    back = ModelConfig.from_dict(cfg.to_dict())
    assert back.design_options("residual").scale == 0.25 and back.to_dict() == cfg.to_dict()
    assert ModelConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "options"}).options == {
        scaled: ScaledOptions()}  # a checkpoint from before options: the design's defaults


@pytest.mark.parametrize("options, key, text", [
    ({"scaled_toy": {"scale": -1.0}}, "options.scaled_toy.scale", "must be > 0, got -1.0"),  # the design's check
    ({"scaled_toy": {"scale": "big"}}, "options.scaled_toy.scale", "must be float, got 'big'"),
    ({"scaled_toy": {"sclae": 2.0}}, "options.scaled_toy", "unknown key(s) sclae; scaled_toy declares scale"),
    ({"nobody": {"x": 1}}, "options.nobody", "no registered design 'nobody' declares options"),
])
def test_bad_registered_keys_are_one_line_problems(scaled, options, key, text) -> None:
    with pytest.raises(ConfigError) as e:
        build_config("debug", residual=scaled, options=options)
    assert [k for k, _ in e.value.problems] == [key]
    assert text in e.value.problems[0][1] and "\n" not in e.value.problems[0][1]


def test_the_reference_lists_a_registered_designs_keys(scaled, tmp_path) -> None:
    from ncpctl.recipe.reference import main, render

    out = main(["--import", "tests.model.toy_options", str(tmp_path / "recipes.md")])  # what a plugin author runs
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| `model.options.{scaled}.scale` |"))
    assert "| float | `1.0` |" in row and "residual scaled_toy: The update's weight" in row
    unregister("residual", scaled)
    assert f"model.options.{scaled}." not in render()
    register("residual", scaled, ScaledResidual)


def test_a_bad_key_exits_2_through_the_cli(tmp_path) -> None:
    """Named by import path, as a user's design is (the key: the path)."""
    from tests.conftest import REPO
    from tests.train.conftest import ncpctl

    path = "tests.model.toy_options:ScaledResidual"
    (tmp_path / "r.yaml").write_text(f"model:\n  size: debug\n  residual: {path}\n"
                                     f"  options:\n    {path!r}:\n      scale: 0\n")
    run = ncpctl("pretrain", str(tmp_path / "r.yaml"), env={"PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr
    assert f"model.options.{path}.scale: must be > 0, got 0" in run.stderr
