"""Stage set-up without an engine: which stages take ``train.lora``, and the training FLOPs per
step that MFU divides (3x forward unless the stage freezes weights)."""

from __future__ import annotations

from functools import partial

import pytest

from ncpctl.errors import UserError
from ncpctl.model.accounting.flops import exact_flops
from ncpctl.recipe import load_recipe
from ncpctl.train.loop import flops_per_step
from ncpctl.train.stages import Stage, freeze_all_but_codebook, make_stage

from ..conftest import RECIPES


def recipe(*sets: str):
    return load_recipe(RECIPES / "debug.yaml", list(sets))


@pytest.mark.parametrize("stage,says", [("adapt-vq", "trains the codebook and concept heads"),
                                        ("pretrain", "trains a model from scratch")])
def test_lora_is_a_midtrain_setup(stage, says) -> None:
    with pytest.raises(UserError, match=says):
        make_stage(recipe("train.lora={rank: 4}"), stage)


def test_lora_refuses_the_optimizer_state_of_a_full_run() -> None:
    with pytest.raises(UserError, match="train.load: all"):
        make_stage(recipe("train.lora={rank: 4}", "train.load=all"), "midtrain")


def test_flops_per_step_counts_the_backward_of_the_stage() -> None:
    from ncpctl.model.core.model import NCPModel

    r = recipe()
    T, G = r.seq_len, r.global_batch_size
    model = NCPModel(r.model_config)
    full = exact_flops(r.model_config, T, G).training_per_step()
    assert flops_per_step(r, Stage("pretrain"), model) == full
    freeze_all_but_codebook(model)
    vq = flops_per_step(r, Stage("adapt-vq", freeze=freeze_all_but_codebook), model)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert vq == exact_flops(r.model_config, T, G, trainable=trained).training_per_step() < 0.75 * full


def test_lora_stage_counts_its_adapters() -> None:
    pytest.importorskip("peft")
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe.schema import LoraSection
    from ncpctl.train.lora import apply_lora

    r = recipe()
    model = NCPModel(r.model_config)
    setup = partial(apply_lora, spec=LoraSection(rank=4))
    setup(model)
    got = flops_per_step(r, Stage("midtrain", freeze=setup), model)
    plain = exact_flops(r.model_config, r.seq_len, r.global_batch_size)
    # no weight gradient but the adapters': below 3x forward, above forward + input gradients
    assert plain.forward_per_step() * 2 < got < plain.training_per_step()
