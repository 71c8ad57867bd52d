"""The training loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq`` (style rule 8).

The stages differ only in set-up (``ncpctl.train.stages``): where the weights come from
(``train.init_from``), what is frozen, and the data (each recipe's own). ``train(recipe, stage,
out)`` then reads top to bottom, one named piece per stage of a run:

    _prepare: distributed set-up -> data -> resume / init checks (before any heavy work)
              -> model -> DeepSpeed engine -> [restore checkpoint] -> observability
    loop:     _optimizer_step (micro-batches fwd/bwd/step, ONE all-reduce of the named step
              vector, see ``ncpctl.train.packing``) -> _count_nonfinite -> the model's
              ``on_step_end`` hook -> _log_step -> _evaluate -> _downstream (train.eval_tasks,
              ``ncpctl.train.downstream``) -> _save
    finish:   final _evaluate and _save, plots, the summary (summary.py)

The loop names no design and no loss term or metric of the model except ``loss`` (the
non-finite check and ``train_loss``): what it logs comes from ``model.log_keys()`` and
``model.stat_keys()``; what a design adds to a run (data beside the tokens, forward inputs,
validation keys, checkpoint keys, plots) comes from its hooks (``ncpctl.train.hooks``), called
at four points: prepare, per micro-batch inputs, evaluation, results. The data checks live in
``ncpctl.train.data``, the DeepSpeed engine in ``ncpctl.train.engine`` (shared with ``ncpctl
profile-kernels`` and ``bench/``).

Runs in one process without a launcher (torch.distributed is initialised here with world
size 1) and under ``deepspeed --num_gpus N`` / a hostfile (rank and world size from the
environment the launcher sets). Every rank executes the same collectives in the same order.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
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
from ncpctl.train import checkpoint as ckpt, downstream, elastic, tracking
from ncpctl.train.config import schedule_change
from ncpctl.train.data import TrainData, open_data
from ncpctl.train.engine import Dist, build_engine, follow_schedule, init_distributed, reset_hyperparameters
from ncpctl.train.hooks import Hooks
from ncpctl.train.metrics import MetricsLog, unigram_entropy, write_plots
from ncpctl.train.packing import LOSS, StepPacking
from ncpctl.train.rates import Rates
from ncpctl.train.stages import Stage, build_model
from ncpctl.train.stopping import Abandoned, Signals, abandon_on_stop, downstream_or_failure
from ncpctl.train.summary import summary
from ncpctl.train.validate import validate


FAULT_ENV = "NCPCTL_FAULT"  # test hook, see Faults


# ----------------------------------------------------------------------------- test hooks


class Faults:
    """Failure injection for the tests, from ``$NCPCTL_FAULT`` (comma-separated):
    ``nan@S`` makes step S's loss NaN; ``kill_in_save@S`` SIGKILLs the process after DeepSpeed
    wrote checkpoint S but before it became ``latest``; ``term@S`` sends the process SIGTERM as
    step S begins (a preemption notice at a known step); ``sleep@SECONDS`` pauses after every
    step (so a test can kill a run mid-way). Unset in normal use.

    An environment variable rather than a recipe key: the faults must reach the real entry
    point (also under the launcher) without becoming part of the documented recipe. So that it
    cannot act unnoticed, any item that is not exactly one of the forms above is an error before
    training starts, and an active spec is announced on stderr (``announce``)."""

    KINDS = {"nan": int, "kill_in_save": int, "term": int, "sleep": float}

    def __init__(self, spec: str):
        self.spec = spec.strip()
        self.items: set[tuple[str, str]] = set()
        self.sleep = 0.0
        for item in filter(None, (x.strip() for x in self.spec.split(","))):
            kind, _, value = item.partition("@")
            try:
                number = self.KINDS[kind](value)
                if number < 0:
                    raise ValueError(value)
            except (KeyError, ValueError):
                raise UserError(f"${FAULT_ENV}={spec!r}: {item!r} is not a test fault "
                                "(nan@STEP, kill_in_save@STEP, term@STEP or sleep@SECONDS)",
                                hint=f"{FAULT_ENV} is a test hook; unset it for real runs") from None
            if kind == "sleep":
                self.sleep = float(number)
            else:
                self.items.add((kind, str(number)))

    def announce(self, warn: Callable[[str], None]) -> None:
        if self.spec:
            warn(f"{FAULT_ENV}={self.spec}: test fault injection is active (unset it for real runs)")

    def nan(self, step: int) -> bool:
        return ("nan", str(step)) in self.items

    def __call__(self, where: str, step: int) -> None:
        if (f"kill_in_{where}", str(step)) in self.items:
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "step" and ("term", str(step)) in self.items:
            os.kill(os.getpid(), signal.SIGTERM)


# ----------------------------------------------------------------------------- a prepared run

FLAGS = ("skipped", "stop")  # the loop's own entries of the step vector, summed over ranks
# the train record's own fields: no log key or statistic of the model may use these names
RECORD_FIELDS = ("split", "step", "lr", "tokens", "grad_norm", "step_time", "tokens_per_s", "mfu", "nonfinite")


def _quiet(msg: str) -> None:
    """``info`` / ``warn`` on the ranks other than 0."""


@dataclass
class _Totals:
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
class _Run:
    """What the loop's pieces read and update; built once by ``_prepare``."""

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
    tot: _Totals = field(default_factory=_Totals)
    # ---- observability (metrics and display on rank 0 only) ----
    flops_per_step: int = 0  # training FLOPs of one optimizer step (the accounting; the budget's unit)
    peak: float = 1.0  # FLOP/s of all ranks together
    peak_source: str = ""  # where the peak comes from (rank 0's device_peak)
    entropy: float | None = None
    metrics: MetricsLog | None = None
    display: Any = None
    # ---- this invocation's clock (the summary's rates) ----
    started: float = 0.0
    first_step: int = 0
    rates: Rates = field(default_factory=Rates)  # this process's step seconds (a compiling first step apart)

    @property
    def root(self) -> Path:
        return ckpt.checkpoints_dir(self.recipe.run_dir)


@dataclass
class _Step:
    """One optimizer step's outcome, global over ranks, by name."""

    lr: float
    terms: dict[str, torch.Tensor]  # log key -> (size,) mean over micro-batches and ranks
    stats: dict[str, float]  # statistic -> total over micro-batches and ranks
    skipped: bool  # a non-finite loss or gradient on some rank: no update was applied
    stopping: bool  # some rank got SIGINT / SIGTERM
    grad_norm: float | None
    seconds: float  # without the stability diagnostics' forward (``attention``'s own seconds)
    attention: dict[str, float] | None = None  # the stability record's numbers, on the steps it is due


# ----------------------------------------------------------------------------- the loop


def train(recipe: Recipe, stage: Stage, out: Any) -> dict[str, Any]:
    """Run ``stage`` for ``recipe``; ``out`` has ``info``/``warn`` and the stderr console ``err``.
    Returns the summary (also what ``--json`` prints)."""
    run = _prepare(recipe, stage, out)
    t, tot = recipe.train, run.tot
    with Signals() as stop:  # a first SIGINT / SIGTERM stops after a save, a second at once (stopping.py)
        run.engine.train()
        run.started, run.first_step = time.perf_counter(), tot.step
        run.rates = Rates.for_run(recipe, run.d.device.type != "cpu", t.max_steps - tot.step, run.info, run.warn)
        if run.display is not None:
            run.display.start(t.max_steps, tot.step)
        try:
            while tot.step < t.max_steps:
                step = _optimizer_step(run, stop)
                run.rates.add(step.seconds, step.attention["seconds"] if step.attention else 0.0)
                if run.metrics is not None and step.attention is not None:  # also when the step is skipped
                    run.metrics.write({"split": "stability", "step": tot.step, **step.attention})
                if run.faults.sleep:
                    time.sleep(run.faults.sleep)
                _count_nonfinite(run, step)  # raises after train.max_nonfinite in a row
                if not step.skipped:  # the model's per-step hook: every rank, after an applied update
                    run.engine.module.on_step_end(step.stats)
                if run.metrics is not None and (tot.step % t.log_every == 0 or tot.step == t.max_steps):
                    _log_step(run, step)

                last, stopping = tot.step == t.max_steps, step.stopping
                # a stopping step saves at once: a preemption's grace period is not spent evaluating,
                # and a signal during an evaluation abandons it (stopping = True)
                if t.eval_every and tot.step % t.eval_every == 0 and not last and not stopping:
                    stopping = _evaluate(run, stop)
                # before the save: the checkpoint has these weights
                if downstream.due(t, tot.step, last) and not stopping:
                    stopping = _downstream(run, stop)
                # no periodic save inside a non-finite streak: if the weights themselves went bad,
                # the checkpoint before the streak is the one to go back to
                due = t.save_every and tot.step % t.save_every == 0 and not last and tot.nonfinite_run == 0
                if due or stopping:
                    with stop.save():  # a second signal waits for it
                        _save(run)
                if stopping:
                    run.info(f"stopped by signal at step {tot.step}; `train.resume: auto` continues from here")
                    break
            else:  # max_steps reached: the final evaluation and checkpoint, unless already there
                if tot.last_saved != tot.step or not tot.val:
                    _evaluate(run, stop, final=True)
                if tot.last_saved != tot.step:
                    with stop.save():
                        _save(run)
        finally:
            if run.display is not None:
                run.display.stop()
            if run.metrics is not None:
                run.metrics.close()
    plots = write_plots(recipe.run_dir, warn=run.warn, **run.hooks.plots()) if run.d.rank == 0 and t.plots else []
    if run.metrics is not None:
        run.metrics.finish([recipe.run_dir / p for p in plots])  # W&B: the plots, then the run's end
    return summary(run, interrupted=bool(stop.signum), plots=plots)


# ----------------------------------------------------------------------------- preparing a run


def _prepare(recipe: Recipe, stage: Stage, out: Any) -> _Run:
    """distributed set-up -> data -> resume / init checks (all before any heavy work) -> model
    -> DeepSpeed engine -> [restore a checkpoint] -> observability."""
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

    run = _Run(recipe, stage, d, faults, info, warn, data, hooks, engine, packing, resume_from,
               n_params, n_trainable, bf16)
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
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=True, elastic=True)
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
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=stage.load == "all",
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


def _restore(run: _Run, meta: dict[str, Any]) -> None:
    """Resume: engine, RNG and counters from the checkpoint. midtrain ``load: all``: the optimizer
    state of init_from, with this recipe's hyperparameters and a fresh schedule."""
    from ncpctl.safe_load import deepspeed_loads_safely

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


def _observe(run: _Run, out: Any) -> None:
    """Rank 0: metrics.jsonl (+ TensorBoard), recipe.resolved.yaml, the live display. Every rank:
    FLOPs per step and the MFU peak of all ranks together (one collective)."""
    r, d = run.recipe, run.d
    lead, on_gpu = d.rank == 0, d.device.type != "cpu"
    t, T, G = r.train, r.seq_len, r.global_batch_size
    if lead:
        resumed = run.resume_from is not None and run.resume_from.parent.resolve() == run.root.resolve()  # own lineage
        tracker = tracking.WandbRun(r, resumed, run.info) if t.wandb is not None else None
        run.metrics = MetricsLog(r.run_dir, t.tensorboard, run.tot.step if run.resume_from else None, run.warn,
                                 tracker)
        r.write_resolved(r.run_dir)
    run.flops_per_step = flops_per_step(r, run.stage, run.engine.module)
    peak, run.peak_source = device_peak(on_gpu)
    run.peak = d.sum(torch.tensor([peak], dtype=torch.float64)).item()
    if lead:
        from ncpctl.train.display import TrainDisplay

        run.entropy = unigram_entropy(run.data.train_tokens(), r.model_config.vocab_size)
        run.display = TrainDisplay(out.err, run.stage.name)
        run.info(f"data: {run.data.loader.num_windows:,} train windows of {T} tokens, global batch {G} "
                 f"({t.micro_batch_size} x {r.grad_accum_steps} accum x {d.world} ranks); "
                 f"unigram entropy {run.entropy:.3f} nats; MFU of {FLOP_CONVENTION_SHORT}")


def flops_per_step(recipe: Recipe, stage: Stage, model: torch.nn.Module, realised_ratio: float | None = None) -> int:
    """Training FLOPs of one optimizer step, the MFU numerator (``ncpctl.model.accounting.flops``): 3x
    forward when every weight trains; for a stage that freezes weights (adapt-vq, LoRA) the
    backward autograd really computes, from the parameters that require grad."""
    trainable = None if stage.freeze is None else {  # ZeRO-3 partitions: ds_numel is the full size
        n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    return recipe.flops_per_step(trainable, realised_ratio)


# ----------------------------------------------------------------------------- one step


def _optimizer_step(run: _Run, stop: Signals) -> _Step:
    """grad_accum micro-batches of (micro, T) on every rank (DeepSpeed updates at the boundary),
    then ONE all-reduce of the step vector: log keys, statistics, flags (``StepPacking``)."""
    r, d, engine, pk = run.recipe, run.d, run.engine, run.packing
    t0 = time.perf_counter()
    lr = float(engine.get_lr()[0])
    nan = run.faults.nan(run.tot.step + 1)
    run.faults("step", run.tot.step + 1)
    engine.module.on_step_begin(run.tot.step)  # schedules inside the model
    batch = torch.from_numpy(next(run.data.loader))  # (micro * accum, T+1) this rank's share
    ids = torch.from_numpy(run.data.loader.sample_ids()).split(r.train.micro_batch_size)  # global sample indices
    extra = run.hooks.inputs(run.data.loader, len(ids), r.train.micro_batch_size, d.device)  # the designs' inputs
    attention = _attention_stats(run, batch[: r.train.micro_batch_size], ids[0], extra[0].get("doc_ids")) \
        if _attention_due(r.train.attention_stats_every, run.tot.step + 1) else None
    keyed = getattr(engine.module, "uses_sample_ids", False)  # the key of a segmenter's sampled boundaries
    terms = torch.zeros(pk.n_terms, device=d.device)
    stats = torch.zeros(len(pk.stats), device=d.device)
    for mb, mb_ids, kw in zip(batch.split(r.train.micro_batch_size), ids, extra):
        # (micro, T) inputs, targets; an objective's noise is keyed on the global sample indices
        x, y = (t.to(d.device) for t in engine.module.objective.keyed_batch(mb, mb_ids))
        if keyed:
            kw["sample_ids"] = mb_ids.to(d.device)
        o = engine(x, y, **kw)
        loss = o.loss * float("nan") if nan else o.loss
        engine.backward(loss)
        engine.step()  # DeepSpeed applies the update at the accumulation boundary
        terms += pk.terms(o, loss)  # an injected NaN shows in the logged loss too
        stats += pk.stat_sums(o)
    run.tot.step += 1
    run.tot.tokens += r.global_batch_size * r.seq_len
    applied = engine.was_step_applied()
    grad_norm = engine.get_global_grad_norm()
    flags = {"skipped": not applied, "stop": stop.signum != 0}
    red = pk.split(d.sum(pk.join(terms / r.grad_accum_steps, stats, flags)), mean_over=d.world)
    skipped = red.flags["skipped"] > 0 or not math.isfinite(red.terms[LOSS].item())
    seconds = time.perf_counter() - t0 - (attention["seconds"] if attention else 0.0)
    return _Step(lr, red.terms, red.stats, skipped, red.flags["stop"] > 0,
                 None if grad_norm is None else float(grad_norm), seconds, attention)


def _attention_due(every: int, step: int) -> bool:
    """``train.attention_stats_every``: at step 1 (1-based; the curves start at the init) and every N-th."""
    return every > 0 and (step == 1 or step % every == 0)


def _attention_stats(run: _Run, mb: torch.Tensor, mb_ids: torch.Tensor,
                     doc_ids: torch.Tensor | None) -> dict[str, float]:
    """The stability diagnostics (``NCPModel.attention_stats``) of this rank's micro-batch mb
    (micro, T+1), before the step's update: the weights the step's loss is computed with (and its
    packed documents, data.document_mask). Max over ranks in one collective; ``seconds``: what it
    took (kept out of the step's time)."""
    t0 = time.perf_counter()
    x, y = (t.to(run.d.device) for t in run.engine.module.objective.keyed_batch(mb, mb_ids))  # (micro, T)
    stats = run.engine.module.attention_stats(x, y, doc_ids=doc_ids)
    values = run.d.max(torch.stack(list(stats.values())).float()) if stats else torch.zeros(0)
    return {**dict(zip(stats, values.tolist())), "seconds": time.perf_counter() - t0}


def _count_nonfinite(run: _Run, step: _Step) -> None:
    """Bad states: a skipped step is counted; train.max_nonfinite in a row stops the run (exit 2)."""
    tot, t = run.tot, run.recipe.train
    if not step.skipped:
        tot.nonfinite_run = 0
        tot.train_loss, tot.train_loss_step = step.terms[LOSS].item(), tot.step
        return
    tot.nonfinite_total += 1
    tot.nonfinite_run += 1
    run.warn(f"step {tot.step}: non-finite loss or gradient; step skipped "
             f"({tot.nonfinite_run} in a row, {tot.nonfinite_total} in total)")
    if tot.nonfinite_run >= t.max_nonfinite:
        last = f"last good checkpoint: {tot.last_good}" if tot.last_good else "no checkpoint was written"
        raise UserError(
            f"training diverged: {tot.nonfinite_run} non-finite steps in a row "
            f"(steps {tot.step - tot.nonfinite_run + 1}-{tot.step}, train.max_nonfinite={t.max_nonfinite})",
            last, hint="lower train.lr, lengthen the warmup or check the data; train.resume: auto "
            "continues from the last good checkpoint")


def _log_step(run: _Run, step: _Step) -> None:
    """The train record (rank 0): the loop's numbers, then the model's log keys and the step
    statistics, by name."""
    r, tot = run.recipe, run.tot
    rec = {"split": "train", "step": tot.step, "lr": step.lr, "tokens": tot.tokens, "grad_norm": step.grad_norm,
           "step_time": step.seconds, "tokens_per_s": r.global_batch_size * r.seq_len / step.seconds,
           "mfu": run.flops_per_step / step.seconds / run.peak, "nonfinite": tot.nonfinite_total,
           **run.packing.record(step.terms), **step.stats}
    run.metrics.write(rec)
    run.display.step(rec)


# ----------------------------------------------------------------------------- evaluate, save, finish


def _evaluate(run: _Run, stop: Signals, final: bool = False) -> bool:
    """Validation on train.eval_batches fixed batches (per data.mix component when the mixture's
    components have validation splits; ``ncpctl.train.validate``), logged and shown. Returns whether
    a stop signal abandoned it (``stopping.abandon_on_stop``: nothing is recorded then)."""
    try:
        with abandon_on_stop(run.engine.module, stop, run.d):
            val = validate(run, final)
    except Abandoned:
        run.engine.train()
        run.info(f"validation at step {run.tot.step} abandoned: a stop signal came; saving now")
        return True
    run.tot.val, run.tot.val_step = val, run.tot.step
    if run.metrics is not None:
        run.metrics.write({"split": "val", "step": run.tot.step, **run.tot.val})
    if run.display is not None:
        run.display.validation(run.tot.step, run.tot.val)
    return False


def _downstream(run: _Run, stop: Signals) -> bool:
    """train.eval_tasks on the live model, every rank; not step time. Returns whether a stop signal
    abandoned it; a failure is recorded and training goes on (``stopping.downstream_or_failure``)."""
    rec = downstream_or_failure(run, stop, lambda: _save(run))
    if rec is None:
        return True
    if "error" not in rec:
        run.tot.downstream = rec
        run.info(downstream.line(rec))
    if run.metrics is not None:
        run.metrics.write(rec)
    return False


def _save(run: _Run) -> None:
    """A checkpoint (collective): DeepSpeed's state plus the training state ncpctl.json records."""
    r, tot, stage = run.recipe, run.tot, run.stage
    meta = {"stage": stage.name, "tokens_seen": tot.tokens, "model_config": r.model_config.to_dict(),
            "optimizer": r.train.optimizer,
            **run.hooks.checkpoint_meta(),  # what the designs record (e.g. their label names)
            "data": {"train": run.data.loader.state_dict(),  # with data.mix: its components in the state
                     "train_prefix": None if r.data.mix and not r.data.train_prefix else str(run.data.train_ds.bin_path)[:-4]},
            "world_size": run.d.world, "zero_stage": r.deepspeed.zero_stage,
            "nonfinite_total": tot.nonfinite_total, "train_loss": tot.train_loss, "val": tot.val,
            "threads": threads.record(),  # the intra-op count changes the numerics (ncpctl.threads)
            "budget": r.budget.record(tot.step, tot.tokens, run.flops_per_step),
            # a decay branch's start (the concrete checkpoint, its step, the stable-phase losses): its resumes
            # and `fit` read it, also once the stable checkpoint is pruned (ncpctl.recipe.length.decay_start)
            "decay_from": r.decay_start,
            "train_loss_step": tot.train_loss_step, "val_step": tot.val_step,
            "init_from": str(stage.init_from) if stage.init_from else None}
    if r.train.lora is not None and stage.name == "midtrain":
        from ncpctl.train.lora import describe

        meta["lora"] = describe(r.train.lora)  # model.safetensors holds the adapters merged in
    tot.last_good = ckpt.save(run.engine, run.root, tot.step, meta, r, rank=run.d.rank,
                              keep_last=r.train.keep_last, barrier=run.d.barrier, fault=run.faults)
    tot.last_saved = tot.step
    run.info(f"[dim]saved {tot.last_good}[/]")
