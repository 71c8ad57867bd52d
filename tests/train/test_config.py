"""The DeepSpeed config, optimizer groups and lr schedule derived from a recipe (no engine)."""

from __future__ import annotations

import math

import pytest
import torch

from ncpctl.recipe import load_recipe
from ncpctl.train.config import deepspeed_config, lr_schedule, make_optimizer, param_groups
from ncpctl.train.stages import freeze_all_but_codebook

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


def test_bf16_runs_deepspeeds_bf16_optimizer_at_zero1_only() -> None:
    """ZeRO-1 bf16: fp32 gradient accumulation, which is DeepSpeed's BF16_Optimizer (one global norm
    decides a skip, no per-tensor overflow pass); other stages keep the ZeRO optimizer and its
    check; ``deepspeed.extra`` can select the ZeRO optimizer back."""
    cfgs = {z: deepspeed_config(recipe("train.precision=bf16", f"deepspeed.zero_stage={z}"), on_gpu=True)
            for z in (0, 1, 2, 3)}
    assert cfgs[1]["data_types"] == {"grad_accum_dtype": "fp32"}
    assert all("data_types" not in cfgs[z] for z in (0, 2, 3))
    assert all(c["bf16"] == {"enabled": True, "check_grad_overflow": True} for c in cfgs.values())
    assert "data_types" not in deepspeed_config(recipe("deepspeed.zero_stage=1"), on_gpu=False)  # fp32
    back = recipe("train.precision=bf16", "deepspeed.zero_stage=1", "deepspeed.extra={data_types: {grad_accum_dtype: bf16}}")
    assert deepspeed_config(back, on_gpu=True)["data_types"] == {"grad_accum_dtype": "bf16"}


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
    from ncpctl.model.core.model import NCPModel

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


def test_depth_mixer_parameters_are_not_decayed() -> None:
    from ncpctl.model.core.model import NCPModel
    from tests.model import toys  # noqa: F401  (registers the toy mixer "dense": Linear layers)
    from tests.model._helpers import tiny

    model = NCPModel(tiny("neox", residual="dense", concept={}))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    mixer = {n for n in names.values() if ".residual." in n}
    assert any(n.endswith("dyn.0.weight") for n in mixer)  # 2-D weights, decayed if not exempt
    assert mixer <= {names[id(p)] for p in groups["no_decay"]["params"]}
    assert "decoder.0.attn.qkv.weight" in {names[id(p)] for p in groups["decay"]["params"]}


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


def test_fault_hook_is_strict_and_inert_when_unset() -> None:
    """$NCPCTL_FAULT (loop.Faults) is a test hook: unset it does nothing, and anything but the
    documented forms is an error, so a stray value can never silently alter a real run."""
    from ncpctl.errors import UserError
    from ncpctl.train.loop import Faults

    none = Faults("")
    assert not none.items and none.sleep == 0 and not none.nan(1)
    warned: list[str] = []
    none.announce(warned.append)
    assert not warned
    f = Faults("nan@4, kill_in_save@6,sleep@0.5")
    assert f.nan(4) and not f.nan(5) and f.sleep == 0.5 and ("kill_in_save", "6") in f.items
    f.announce(warned.append)
    assert warned and "test fault injection is active" in warned[0]
    for bad in ("1", "nan", "nan@x", "nan@-1", "kill@3", "NAN@4", "sleep@"):
        with pytest.raises(UserError, match="is not a test fault"):
            Faults(bad)


def test_optimizer_gets_the_recipes_hyperparameters() -> None:
    """betas, eps, weight decay, lr and clipping reach the optimizer and DeepSpeed unchanged."""
    from ncpctl.model.core.model import NCPModel

    sets = ("train.betas=[0.8, 0.9]", "train.eps=1e-6", "train.weight_decay=0.05", "train.lr=2e-3",
            "train.grad_clip=0.7")
    for stage in (0, 1, 3):
        r = recipe(*sets, f"deepspeed.zero_stage={stage}")
        opt = make_optimizer(NCPModel(r.model_config), r, on_gpu=False)
        for g in opt.param_groups:
            assert g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["lr"] == 2e-3
            assert g["weight_decay"] == (0.05 if g["name"] == "decay" else 0.0)
        clip = deepspeed_config(r, on_gpu=False)["gradient_clipping"]
        # stage 0 fp32: our optimizer clips; ZeRO: DeepSpeed clips. Exactly one of them, at 0.7.
        assert (opt.guard, opt.max_norm, clip) == ((True, 0.7, 0.0) if stage == 0 else (False, 0.7, 0.7))


def test_pythia_schedule() -> None:
    """Pythia: warmup 1% of the steps, cosine from lr to min_lr = lr/10 at the last step."""
    r = load_recipe(RECIPES / "pythia160m.yaml", ["data.train_prefix=", "data.val_prefix=",
                                                    "tokenizer.path=", "tokenizer.vocab_size=50277"])
    t = r.train
    assert (t.lr, t.min_lr, t.betas, t.eps, t.weight_decay, t.grad_clip) == (6e-4, 6e-5, [0.9, 0.95], 1e-8, 0.1, 1.0)
    assert r.warmup_steps == round(0.01 * t.max_steps) == 1430
    f = lr_schedule(r)
    assert f(0) == pytest.approx(1 / 1430) and f(1429) == pytest.approx(1.0)
    assert f(t.max_steps) == pytest.approx(0.1) and f(t.max_steps - 1) > 0.1


def test_a_resume_under_another_schedule_is_described():
    """Issue 28 item 4: resuming with another max_steps (or warmup, lr, min_lr) silently reshaped the
    learning-rate schedule; ``schedule_change`` names what changed and the lr at the resumed step
    under both schedules, and says nothing when the schedule is the same."""
    from ncpctl.train.config import schedule_change

    r = recipe("train.max_steps=500", "train.warmup_fraction=0.05", "train.lr=3e-3", "train.min_lr=3e-4")
    same = {"max_steps": 500, "warmup_fraction": 0.05, "warmup_steps": None, "lr": 3e-3, "min_lr": 3e-4}
    assert schedule_change(same, r, 100) is None
    old = {**same, "max_steps": 300}  # the checkpoint's run ended its cosine at 300; warmup 15 steps
    line = schedule_change(old, r, 300)
    assert line.startswith("the learning-rate schedule differs from the checkpoint's (max_steps 300 -> 500, "
                           "warmup 15 -> 25): from step 300")
    new_lr = 3e-3 * lr_schedule(r)(300)
    assert f"({new_lr:.3g} now; the old schedule would give {3e-4:.3g})" in line
    assert schedule_change({"lr": "x"}, r, 3) is None  # an unreadable record: nothing to compare
