"""The DeepSpeed config, optimizer groups and lr schedule derived from a recipe (no engine)."""

from __future__ import annotations

import math

import pytest
import torch

from ncpctl.recipe import load_recipe
from ncpctl.train.config import deepspeed_config, lr_schedule, make_optimizer, param_groups
from ncpctl.train.loop import freeze_all_but_codebook

from ..conftest import RECIPES


def recipe(*sets: str, world_size: int = 1):
    return load_recipe(RECIPES / "debug.yaml", list(sets), world_size=world_size)


def test_batch_sizes_come_from_the_recipe() -> None:
    r = recipe("train.micro_batch_size=2", "train.global_batch_size=16", "deepspeed.zero_stage=2", world_size=2)
    cfg = deepspeed_config(r, on_gpu=False)
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 4  # 16 / (2 x 2 ranks)
    assert cfg["train_batch_size"] == 16
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"]["enabled"] is False  # auto on CPU = fp32


def test_precision_and_stage0_clipping() -> None:
    assert deepspeed_config(recipe("train.precision=auto"), on_gpu=True)["bf16"]["enabled"] is True
    # stage 0 fp32: our optimizer clips and guards, DeepSpeed's clipping is off
    cfg = deepspeed_config(recipe("deepspeed.zero_stage=0"), on_gpu=False)
    assert cfg["gradient_clipping"] == 0.0


def test_extra_is_merged_last() -> None:
    r = recipe("deepspeed.zero_stage=1", "deepspeed.extra={zero_optimization: {reduce_bucket_size: 1000}, "
               "steps_per_print: 7}")
    cfg = deepspeed_config(r, on_gpu=False)
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert cfg["steps_per_print"] == 7


def test_warmup_then_cosine_to_min_lr() -> None:
    r = recipe("train.max_steps=100", "train.warmup_steps=10", "train.lr=1.0", "train.min_lr=0.1")
    f = lr_schedule(r)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def test_weight_decay_groups_and_frozen_parameters() -> None:
    from ncpctl.model.model import NCPModel

    r = recipe()
    model = NCPModel(r.model_config)
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert "embed.weight" in plain and "lm_head.weight" in decayed
    assert all(not n.endswith("bias") for n in decayed)
    assert "concept.codebook.base" not in decayed | plain  # SimVQ base: frozen
    freeze_all_but_codebook(model)
    opt = make_optimizer(model, r, on_gpu=False)
    trained = {names[id(p)] for g in opt.param_groups for p in g["params"]}
    assert trained and all(n.startswith(("concept.heads", "concept.codebook.transform")) for n in trained)


def test_guarded_optimizer_skips_nonfinite_and_reports_the_preclip_norm() -> None:
    r = recipe("deepspeed.zero_stage=0", "train.grad_clip=1.0")
    model = torch.nn.Linear(4, 4)
    opt = make_optimizer(model, r, on_gpu=False)
    before = model.weight.detach().clone()
    model.weight.grad = torch.full((4, 4), float("nan"))
    model.bias.grad = torch.zeros(4)
    opt.step()
    assert opt.overflow and torch.equal(model.weight, before)
    model.weight.grad = torch.full((4, 4), 10.0)
    opt.step()
    assert not opt.overflow and opt._global_grad_norm == pytest.approx(40.0)
    assert not torch.equal(model.weight, before)


def test_extra_may_not_override_what_the_recipe_owns() -> None:
    from ncpctl.errors import UserError

    with pytest.raises(UserError) as e:
        recipe("deepspeed.extra={train_batch_size: 3, gradient_clipping: 0.5, zero_optimization: {stage: 2}}")
    text = "\n".join(e.value.problems)
    assert "deepspeed.extra.train_batch_size: set by ncpctl from train.global_batch_size" in text
    assert "deepspeed.extra.gradient_clipping" in text and "deepspeed.extra.zero_optimization.stage" in text
