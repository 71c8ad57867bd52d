"""The three training stages, which differ in set-up only (style rule 8): ``make_stage(recipe, name)``.

``pretrain`` trains a model from scratch; ``midtrain`` continues a checkpoint (or a Hugging Face
directory: ConceptLM's continual pretraining), optionally with LoRA adapters (``train.lora``,
``ncpctl.train.lora``); ``adapt-vq`` adapts a checkpoint's codebook and concept heads, everything
else frozen (NCP-ArchPreview Sec. 5.1). ``build_model`` gives a run its model with the stage's
set-up; ``ncpctl.train.loop.train`` runs any of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train import checkpoint as ckpt

@dataclass
class Stage:
    """What differs between pretrain, midtrain and adapt-vq: set-up only."""

    name: str  # "pretrain" | "midtrain" | "adapt-vq"
    init_from: Path | None = None  # checkpoint (or HF directory) whose weights start the run
    load: str = "weights"  # "weights" (fresh optimizer) | "all" (also the optimizer state)
    # what the stage does to the model once its weights are in (also when resuming): adapt-vq
    # freezes all but the codebook; LoRA freezes everything and adds adapters. None: all train.
    freeze: Callable[[torch.nn.Module], None] | None = None
    hf: bool = False  # init_from is a Hugging Face directory (midtrain: ConceptLM continual pretraining)
    # what the loop trains in place of the model once it is set up (train-drafter: the frozen target
    # wrapped with a new drafter, ncpctl.train.designs.drafter); None: the model itself
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    # the stage's own check of a checkpoint it resumes (path, its ncpctl.json), beyond the model config
    # the loop compares (train-drafter: the drafter's config); raises a UserError
    check_resume: Callable[[Path, dict], None] | None = None
    # the stage trains train.drafter (train-drafter); every other stage refuses a recipe that sets it
    trains_drafter: bool = False


def freeze_all_but_codebook(model: torch.nn.Module) -> None:
    """NCP-ArchPreview §5.1: only the codebook and the concept heads train. With ``codebook:
    learned`` the codebook is ``base`` itself (the paper's setting: at 8.9B, 16,777,216 head
    weights + 524,288 codes = 17,301,504 trained); with ``simvq`` the trained part of the
    codebook is its transform (the frozen Gaussian base stays frozen). The concept norm before
    the heads, like every other weight, stays frozen."""
    concept = model.concept
    for p in model.parameters():
        p.requires_grad_(False)
    cb = concept.codebook
    trainable = [concept.heads, cb.transform] if cb.transform is not None else [concept.heads]
    for module in trainable:
        for p in module.parameters():
            p.requires_grad_(True)
    if cb.transform is None:
        cb.base.requires_grad_(True)


def _lora_setup(recipe: Recipe, name: str) -> Callable[[torch.nn.Module], None] | None:
    """``train.lora``'s set-up (midtrain only), checked before any heavy work."""
    spec = recipe.train.lora
    if spec is None:
        return None
    if name != "midtrain":
        does = "trains the codebook and concept heads" if name == "adapt-vq" else "trains a model from scratch"
        raise UserError(f"{recipe.path}: train.lora: LoRA adapts a checkpoint with `ncpctl midtrain`; "
                        f"`ncpctl {name}` {does}", hint=f"run `ncpctl midtrain {recipe.path}`, or remove train.lora")
    if recipe.train.load == "all":
        raise UserError(f"{recipe.path}: train.load: all restores the optimizer state of init_from's weights; a LoRA "
                        "run trains new adapters", hint="use train.load: weights")
    from functools import partial

    from ncpctl.train.lora import apply_lora, lora_config

    lora_config(spec)  # peft present, the section well-formed
    return partial(apply_lora, spec=spec)


def _drafter_stage(recipe: Recipe, init: Path) -> Stage:
    """``train-drafter``: the frozen target of ``train.init_from`` wrapped with a new drafter."""
    from ncpctl.train.designs.drafter import DraftTraining, drafter_config
    from ncpctl.train.hooks import Hooks

    t = recipe.train
    if t.drafter is None:
        raise UserError(f"{recipe.path}: train.drafter: `ncpctl train-drafter` trains a drafter; none given",
                        hint="add train.drafter: {k: 8} (see recipes/drafters/)")
    others = [h.recipe_key or type(h).__name__ for h in Hooks(recipe).each if not h.with_drafter]
    if others or t.lora is not None:
        raise UserError(f"{recipe.path}: a drafter trains against a plain target run; this one adds "
                        f"{', '.join(others) or 'train.lora'}",
                        hint="set train.plots: false and no train.lora; a target whose design adds the other "
                             "keys named has no drafter in ncpctl")
    try:
        cfg = drafter_config(recipe)
    except ValueError as e:
        raise UserError(f"{recipe.path}: train.drafter: {e}") from None
    anchors, decay = t.drafter.anchors, t.drafter.decay

    def freeze(model: torch.nn.Module) -> None:
        model.requires_grad_(False)

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if model.objective.block_sampling or not model.objective.causal:
            raise UserError(f"{recipe.path}: train.init_from: objective {recipe.model_config.objective} does not "
                            "decode token by token on KV caches: no drafter can speed it up")
        try:
            return DraftTraining(model, cfg, anchors, decay)
        except ValueError as e:
            raise UserError(f"{recipe.path}: train.init_from: {e}") from None

    def check_resume(src: Path, meta: dict) -> None:
        saved = (meta.get("drafter") or {}).get("config") or {}
        diff = sorted(k for k in cfg.to_dict() if saved.get(k) != cfg.to_dict()[k])
        if diff:
            raise UserError(f"{src}: train.drafter: the checkpoint's drafter differs in "
                            + ", ".join(f"{k} ({saved.get(k)!r}, now {cfg.to_dict()[k]!r})" for k in diff),
                            hint="give this drafter its own run.dir, or train.resume: never")

    return Stage("train-drafter", init, "weights", freeze=freeze, wrap=wrap, check_resume=check_resume,
                 trains_drafter=True)


def make_stage(recipe: Recipe, name: str) -> Stage:
    t = recipe.train
    lora = _lora_setup(recipe, name)
    stage = _build_stage(recipe, name, lora)
    if t.drafter is not None and not stage.trains_drafter:
        raise UserError(f"{recipe.path}: train.drafter: a drafter is trained with `ncpctl train-drafter`",
                        hint=f"run `ncpctl train-drafter {recipe.path}`, or remove train.drafter")
    return stage


def _build_stage(recipe: Recipe, name: str, lora: Callable[[torch.nn.Module], None] | None) -> Stage:
    from ncpctl.train.tracking import require

    t = recipe.train
    require(recipe)  # train.wandb without wandb installed: one line naming the install command
    if name == "pretrain":
        return Stage(name)
    if not t.init_from:
        raise UserError(f"{recipe.path}: train.init_from: `ncpctl {name}` starts from a checkpoint; none given",
                        hint="--set train.init_from=runs/<run>/checkpoints/step_... (or a run directory)")
    from ncpctl.interop.hf_import import is_hf_dir

    if name == "midtrain" and is_hf_dir(t.init_from):
        if t.load == "all":
            raise UserError(f"{recipe.path}: train.load: all needs an ncpctl checkpoint; {t.init_from} is a "
                            "Hugging Face directory (weights only)", hint="use train.load: weights")
        return Stage(name, Path(t.init_from), "weights", freeze=lora, hf=True)
    init = ckpt.resolve(t.init_from, "train.init_from")
    if t.load == "all" and "authors" in ckpt.read_meta(init):  # a released model: weights, no optimizer state
        raise UserError(f"{recipe.path}: train.load: all needs an ncpctl checkpoint; {t.init_from} is a released "
                        "model in its authors' layout (weights only)", hint="use train.load: weights")
    if name == "train-drafter":
        return _drafter_stage(recipe, init)
    if name == "midtrain":
        return Stage(name, init, t.load, freeze=lora)
    cfg = recipe.model_config
    if cfg is None or not cfg.concept.enabled:
        raise UserError(f"{recipe.path}: model.concept.enabled: adapt-vq adapts the codebook; this model has no "
                        "concept path")
    return Stage(name, init, "weights", freeze_all_but_codebook)


def build_model(recipe: Recipe, stage: Stage, *, fresh: bool, info: Callable[[str], None]) -> torch.nn.Module:
    """The model, seeded alike on every rank, with the stage's set-up: its first weights (a
    checkpoint or a Hugging Face directory; none when resuming), then what it freezes."""
    from ncpctl.model.core.model import NCPModel

    t, cfg = recipe.train, recipe.model_config
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)  # the fresh parts (e.g. a new concept path) start the same on every rank
    if stage.hf and fresh:
        model = _hf_model(stage.init_from, cfg, t.zero_concept_output)
        info(f"initialised from the Hugging Face model {stage.init_from}")
    else:
        model = NCPModel(cfg)
        if stage.init_from is not None and fresh:
            model.load_state_dict(ckpt.read_weights(stage.init_from))
            info(f"initialised from {stage.init_from} "
                 f"({'weights only' if stage.load == 'weights' else 'weights + optimizer'})")
    if stage.freeze is not None:
        stage.freeze(model)
    if stage.wrap is not None:
        torch.manual_seed(t.seed)  # the new part starts the same whatever the target's init drew
        model = stage.wrap(model)
    return model


def _hf_model(directory: Path, cfg: Any, zero_concept_output: bool) -> torch.nn.Module:
    """The Hugging Face weights in ``cfg``, which the recipe loader resolved from the HF config
    plus the recipe's keys (``load_hf_pretrained`` runs its weight checks)."""
    from ncpctl.interop.hf_import import load_hf_pretrained

    return load_hf_pretrained(directory, cfg=cfg, zero_concept_output=zero_concept_output)
