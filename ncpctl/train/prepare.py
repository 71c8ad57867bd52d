"""A training run, prepared (``prepare``): everything the loop (``ncpctl.train.loop``) reads and
updates, built once before the first step, in this order:

    distributed set-up -> data -> resume / init checks (before any heavy work) -> model -> DeepSpeed
    engine -> [restore checkpoint] -> observability (metrics, display, FLOPs and the MFU peak) and
    the run's callbacks (``ncpctl.train.callbacks.build``)

``Run`` holds the pieces (recipe, stage, ranks, data, the designs' hooks, the engine, the step
vector's packing, the ZeRO stage's owner ``zero``) and the counters (``Totals``) a checkpoint
records and a resume restores.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from ncpctl import threads
from ncpctl.checkpoint import check_latest, elastic_dir
from ncpctl.errors import UserError
from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT
from ncpctl.profile.timing import device_peak
from ncpctl.recipe.load import Recipe
from ncpctl.safe_load import deepspeed_loads_safely
from ncpctl.train import checkpoint as ckpt, downstream, elastic, tracking
from ncpctl.train.callbacks import Callbacks, build as build_callbacks
from ncpctl.train.data import TrainData, open_data
from ncpctl.train.display import TrainDisplay
from ncpctl.train.engine import Dist, build_engine, follow_schedule, init_distributed, reset_hyperparameters
from ncpctl.train.faults import FAULT_ENV, Faults
from ncpctl.train.hooks import Hooks
from ncpctl.train.metrics import MetricsLog, unigram_entropy
from ncpctl.train.optimizer import schedule_change
from ncpctl.train.packing import StepPacking
from ncpctl.train.rates import Rates
from ncpctl.train.stages import Stage, build_model
from ncpctl.train.zero import Zero

FLAGS = ("skipped", "stop")  # the loop's own entries of the step vector, summed over ranks
# the train record's own fields: no log key or statistic of the model may use these names
RECORD_FIELDS = ("split", "step", "lr", "tokens", "grad_norm", "step_time", "tokens_per_s", "mfu", "nonfinite")


def _quiet(msg: str) -> None:
    """``info`` / ``warn`` on the ranks other than 0."""


@dataclass
class Totals:
    """The run's counters and last figures: what a checkpoint records and a resume restores."""

    step: int = 0
    tokens: int = 0
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    last_saved: int = -1
    last_good: Path | None = None
    train_loss: float | None = None
    train_loss_step: int | None = None  # the step ``train_loss`` was measured at
    val: dict[str, float] = field(default_factory=dict)
    val_step: int | None = None  # the step ``val`` was measured at (a summary after Ctrl-C says so)
    downstream: dict[str, Any] = field(default_factory=dict)  # the last train.eval_tasks record (its step in it)


@dataclass
class Run:
    """What the loop's pieces read and update; built once by ``prepare``."""

    recipe: Recipe
    stage: Stage
    d: Dist
    faults: Faults
    info: Callable[[str], None]
    warn: Callable[[str], None]
    data: TrainData
    hooks: Hooks  # the designs' (ncpctl.train.hooks)
    engine: Any
    packing: StepPacking
    resume_from: Path | None
    n_params: int
    n_trainable: int
    bf16: bool
    zero: Zero  # the ZeRO stage's one owner (ncpctl.train.zero): what depends on the stage asks it
    tot: Totals = field(default_factory=Totals)
    # ---- observability (metrics and display on rank 0 only) ----
    flops_per_step: int = 0  # training FLOPs of one optimizer step (the accounting; the budget's unit)
    peak: float = 1.0  # FLOP/s of all ranks together
    peak_source: str = ""  # where the peak comes from (rank 0's device_peak)
    entropy: float | None = None
    callbacks: Callbacks = field(default_factory=lambda: Callbacks([]))  # built by _observe (ncpctl.train.callbacks)
    # ---- this invocation's clock (the summary's rates) ----
    started: float = 0.0
    first_step: int = 0
    rates: Rates = field(default_factory=Rates)  # this process's step seconds (a compiling first step apart)

    @property
    def root(self) -> Path:
        return ckpt.checkpoints_dir(self.recipe.run_dir)


def prepare(recipe: Recipe, stage: Stage, out: Any) -> Run:
    """distributed set-up -> data -> resume / init checks (all before any heavy work) -> model
    -> DeepSpeed engine -> [restore a checkpoint] -> observability and callbacks."""
    assert recipe.model_config is not None
    faults = Faults(os.environ.get(FAULT_ENV, ""))  # test hook; a malformed spec fails here
    d = init_distributed(out.info if os.environ.get("RANK", "0") == "0" else _quiet)  # rank 0 speaks
    info, warn = (out.info, out.warn) if d.rank == 0 else (_quiet, _quiet)
    faults.announce(warn)
    hooks = Hooks(recipe)
    data = open_data(recipe, d.rank, d.world, hooks, info)
    resume_from, meta = _weights_source(recipe, stage, d, data.loader, warn)
    _move_foreign_checkpoints(recipe, resume_from, d, warn)

    model = build_model(recipe, stage, fresh=resume_from is None, info=info)
    if stage.freeze is not None:  # a FLOPs budget at the backward this stage really does (before the schedule)
        recipe.set_step_cost(flops_per_step(recipe, stage, model))
    if recipe.budget.kind != "steps":
        b = recipe.budget
        info(f"budget: train.{b.key}={b.value:g} = {recipe.train.max_steps:,} optimizer steps of {b.per_step:,} "
             f"{'tokens' if b.kind == 'tokens' else 'training FLOPs (' + FLOP_CONVENTION_SHORT + ')'}")
    hooks.prepare(model, train_ds=data.train_ds, loader=data.loader, info=info)
    packing = StepPacking.for_model(model, FLAGS, reserved=RECORD_FIELDS)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info(f"model {recipe.model_config.name}: {n_params:,} parameters, {n_trainable:,} trainable; {threads.describe()}")
    engine, bf16 = build_engine(recipe, model, d, info, warn)

    run = Run(recipe, stage, d, faults, info, warn, data, hooks, engine, packing, resume_from,
              n_params, n_trainable, bf16, Zero.of(recipe))
    downstream.prepare(run)  # train.eval_tasks load (rank 0 first) before any step or record
    _restore(run, meta)
    _observe(run, out)
    return run


def _weights_source(recipe: Recipe, stage: Stage, d: Dist, loader: Any,
                    warn: Callable[[str], None]) -> tuple[Path | None, dict[str, Any]]:
    """Where the weights come from: resume (same run) wins over init_from (another run). Checks
    that the checkpoint fits (before any heavy work) and positions the loader when resuming.
    Returns the checkpoint to resume from (or None) and its metadata."""
    t, cfg = recipe.train, recipe.model_config
    # every rank, before rank 0 alone picks the checkpoint: a ``latest`` the run could not replace
    # (a directory, a symbolic link) is one line on every rank, not an error on one and a hang on the others
    check_latest(ckpt.checkpoints_dir(recipe.run_dir))
    resume_from: Path | None = None
    if t.resume == "auto":
        resume_from = _resume_checkpoint(recipe, d, warn)
        if resume_from is None and t.decay_from:  # a decay branch's start (its own checkpoints come first)
            resume_from = ckpt.resolve(recipe.decay_start["path"], "train.decay_from", pin_it=False)  # as resolved
    elif t.resume != "never":
        resume_from = ckpt.resolve(t.resume, "train.resume", pin_it=False)
    if resume_from is not None:
        meta = ckpt.read_meta(resume_from)
        ckpt.check_compatible(resume_from, meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=Zero.of(recipe).stage, optimizer_state=True, elastic=True)
        if meta.get("stage", stage.name) != stage.name:
            raise UserError(f"{resume_from}: a {meta['stage']} checkpoint; this is `ncpctl {stage.name}`",
                            hint="give this stage its own run.dir, or train.resume: never")
        if stage.check_resume is not None:  # what the stage trains beyond the model config
            stage.check_resume(resume_from, meta)
        _check_optimizer(recipe, resume_from, meta)
        loader.load_state_dict(meta["data"]["train"], source=str(resume_from / ckpt.META))
        return resume_from, meta
    if stage.init_from is not None and not stage.hf:
        init_meta = ckpt.read_meta(stage.init_from)
        ckpt.check_compatible(stage.init_from, init_meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=Zero.of(recipe).stage, optimizer_state=stage.load == "all",
                              new_stage=True)
        if stage.load == "all":
            _check_optimizer(recipe, stage.init_from, init_meta)
    return None, {}


def _resume_checkpoint(recipe: Recipe, d: Dist, warn: Callable[[str], None]) -> Path | None:
    """``train.resume: auto``: rank 0 picks (and verifies) the checkpoint, moving damaged ones aside;
    the other ranks learn its choice by an all-reduce."""
    root = ckpt.checkpoints_dir(recipe.run_dir)
    if d.world == 1:
        return ckpt.latest_checkpoint(root, warn)
    chosen = ckpt.latest_checkpoint(root, warn) if d.rank == 0 else None
    pick = torch.tensor([int(chosen.name.removeprefix("step_")) if chosen else -1], dtype=torch.float64)
    step = int(d.sum(pick if d.rank == 0 else torch.zeros_like(pick)).item())
    return root / ckpt.tag_for(step) if step >= 0 else None


def _check_optimizer(recipe: Recipe, src: Path, meta: dict[str, Any]) -> None:
    """Optimizer state is only loadable into the same train.optimizer (checkpoints before the key: adamw)."""
    saved = meta.get("optimizer", "adamw")
    if saved != recipe.train.optimizer:
        raise UserError(f"{src}: train.optimizer: {saved} in the checkpoint, {recipe.train.optimizer} now",
                        hint=f"keep train.optimizer: {saved}, or start a fresh optimizer (midtrain with train.load: weights)")


def _move_foreign_checkpoints(recipe: Recipe, resume_from: Path | None, d: Dist, warn: Callable[[str], None]) -> None:
    """A fresh lineage in a run.dir that holds other checkpoints: move them aside (never delete),
    so keep_last and ``latest`` only ever see this run's checkpoints."""
    root = ckpt.checkpoints_dir(recipe.run_dir)
    if (resume_from is None or resume_from.parent != root) and any(root.glob("step_*")):
        if d.rank == 0:
            aside = root.with_name(f"checkpoints.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(root, aside)
            warn(f"{root} held checkpoints this run does not continue from; moved them to {aside}")
        d.barrier()


def _recorded_train(src: Path) -> dict[str, Any]:
    """The ``train`` section of the recipe a checkpoint was written by ({} if unreadable)."""
    try:
        tree = yaml.safe_load((src / "recipe.resolved.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return tree.get("train", {}) if isinstance(tree, dict) and isinstance(tree.get("train"), dict) else {}


def _restore(run: Run, meta: dict[str, Any]) -> None:
    """Resume: engine, RNG and counters from the checkpoint. midtrain ``load: all``: the optimizer
    state of init_from, with this recipe's hyperparameters and a fresh schedule."""
    t, tot, engine = run.recipe.train, run.tot, run.engine
    if run.resume_from is not None:
        src = run.resume_from
        if meta.get("world_size", run.d.world) != run.d.world:  # re-partitioned for this world size
            elastic.load(engine, src, meta["world_size"], meta["zero_stage"], elastic_dir(run.recipe.run_dir),
                         run.d, run.info)
        else:
            if run.d.rank == 0:  # a copy an earlier resume across world sizes left when it was killed
                shutil.rmtree(elastic_dir(run.recipe.run_dir), ignore_errors=True)
            with deepspeed_loads_safely():  # DeepSpeed would unpickle with weights_only=False
                engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
        ckpt.load_rng(src, run.d.rank)
        tot.step, tot.tokens = meta["step"], meta["tokens_seen"]
        tot.nonfinite_total = meta.get("nonfinite_total", 0)
        tot.last_saved, tot.last_good = tot.step, src
        tot.train_loss, tot.val = meta.get("train_loss"), meta.get("val") or {}
        tot.train_loss_step, tot.val_step = meta.get("train_loss_step"), meta.get("val_step")
        run.info(f"resumed from {src} (step {tot.step}, {tot.tokens:,} tokens)"
                 + ("; already at train.max_steps, nothing to do" if tot.step >= t.max_steps else ""))
        recorded = _recorded_train(src)
        if recorded.get("max_steps") is None and isinstance(meta.get("budget"), dict):  # a budget's run
            recorded["max_steps"] = meta["budget"].get("max_steps")
        changed = schedule_change(recorded, run.recipe, follow_schedule(engine, run.recipe))  # the log agrees
        if t.decay_from and src.parent != run.root:  # a decay branch: the schedule changes by design
            run.info(f"decay branch from {src}: {run.recipe.decay_steps} decay steps ({t.decay_shape}) from step "
                     f"{tot.step} to {t.max_steps}")
        elif changed and run.d.rank == 0:
            run.warn(changed)
    elif run.stage.init_from is not None and run.stage.load == "all":
        src = run.stage.init_from
        with deepspeed_loads_safely():
            engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
        reset_hyperparameters(engine, run.recipe)


def _observe(run: Run, out: Any) -> None:
    """Rank 0: metrics.jsonl (+ TensorBoard, W&B), recipe.resolved.yaml, the live display. Every rank:
    FLOPs per step and the MFU peak of all ranks together (one collective), then the callbacks."""
    r, d = run.recipe, run.d
    lead, on_gpu = d.rank == 0, d.device.type != "cpu"
    t, T, G = r.train, r.seq_len, r.global_batch_size
    metrics = display = None
    if lead:
        resumed = run.resume_from is not None and run.resume_from.parent.resolve() == run.root.resolve()  # own lineage
        tracker = tracking.WandbRun(r, resumed, run.info) if t.wandb is not None else None
        metrics = MetricsLog(r.run_dir, t.tensorboard, run.tot.step if run.resume_from else None, run.warn, tracker)
        r.write_resolved(r.run_dir)
    run.flops_per_step = flops_per_step(r, run.stage, run.engine.module)
    peak, run.peak_source = device_peak(on_gpu)
    run.peak = d.sum(torch.tensor([peak], dtype=torch.float64)).item()
    if lead:
        run.entropy = unigram_entropy(run.data.train_tokens(), r.model_config.vocab_size)
        display = TrainDisplay(out.err, run.stage.name)
        run.info(f"data: {run.data.loader.num_windows:,} train windows of {T} tokens, global batch {G} "
                 f"({t.micro_batch_size} x {r.grad_accum_steps} accum x {d.world} ranks); "
                 f"unigram entropy {run.entropy:.3f} nats; MFU of {FLOP_CONVENTION_SHORT}")
    run.callbacks = build_callbacks(run, metrics, display)


def flops_per_step(recipe: Recipe, stage: Stage, model: torch.nn.Module, realised_ratio: float | None = None) -> int:
    """Training FLOPs of one optimizer step, the MFU numerator (``ncpctl.model.accounting.flops``): 3x
    forward when every weight trains; for a stage that freezes weights (adapt-vq, LoRA) the
    backward autograd really computes, from the parameters that require grad."""
    trainable = None if stage.freeze is None else {  # ZeRO-3 partitions: ds_numel is the full size
        n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    return recipe.flops_per_step(trainable, realised_ratio)


