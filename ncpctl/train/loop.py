"""The training loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq`` (style rule 8): the step
and the schedule.

The stages differ only in set-up (``ncpctl.train.stages``): where the weights come from
(``train.init_from``), what is frozen, and the data (each recipe's own). ``train(recipe, stage,
out)`` then reads top to bottom:

    prepare:  ``ncpctl.train.prepare`` (distributed set-up, data, resume checks, model, engine,
              restore, observability, the run's callbacks)
    loop:     _optimizer_step (micro-batches fwd/bwd/step, ONE all-reduce of the named step
              vector, see ``ncpctl.train.packing``) -> _count_nonfinite -> the model's
              ``on_step_end`` hook -> the train record -> _evaluate -> the callbacks'
              evaluations (train.eval_tasks) -> _save when due or stopping
    finish:   final _evaluate and _save, plots, the summary (summary.py)

What watches or extends a run (metrics.jsonl / TensorBoard / W&B, the display, the in-loop
downstream evaluation, the checkpoint cadence, the tests' fault injection) is a callback
(``ncpctl.train.callbacks``) called at named points; the loop names none of them.

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
import time
from dataclasses import dataclass
from typing import Any

import torch

from ncpctl import threads
from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train import checkpoint as ckpt
from ncpctl.train.lora import describe
from ncpctl.train.metrics import write_plots
from ncpctl.train.packing import LOSS
from ncpctl.train.prepare import Run, prepare
from ncpctl.train.rates import Rates
from ncpctl.train.stages import Stage
from ncpctl.train.stopping import Abandoned, Signals, abandon_on_stop
from ncpctl.train.summary import summary
from ncpctl.train.validate import validate


@dataclass
class Step:
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
    run = prepare(recipe, stage, out)
    t, tot = recipe.train, run.tot
    with Signals() as stop:  # a first SIGINT / SIGTERM stops after a save, a second at once (stopping.py)
        run.engine.train()
        run.started, run.first_step = time.perf_counter(), tot.step
        run.rates = Rates.for_run(recipe, run.d.device.type != "cpu", t.max_steps - tot.step, run.info, run.warn)
        run.callbacks.train_start(run)
        try:
            while tot.step < t.max_steps:
                step = _optimizer_step(run, stop)
                run.rates.add(step.seconds, step.attention["seconds"] if step.attention else 0.0)
                if step.attention is not None and run.callbacks.records:  # also when the step is skipped
                    run.callbacks.record(run, {"split": "stability", "step": tot.step, **step.attention})
                run.callbacks.step_end(run, step)
                _count_nonfinite(run, step)  # raises after train.max_nonfinite in a row
                if not step.skipped:  # the model's per-step hook: every rank, after an applied update
                    run.engine.module.on_step_end(step.stats)
                if run.callbacks.records and (tot.step % t.log_every == 0 or tot.step == t.max_steps):
                    run.callbacks.record(run, _train_record(run, step))

                last, stopping = tot.step == t.max_steps, step.stopping
                # a stopping step saves at once: a preemption's grace period is not spent evaluating,
                # and a signal during an evaluation abandons it (stopping = True)
                if t.eval_every and tot.step % t.eval_every == 0 and not last and not stopping:
                    stopping = _evaluate(run, stop)
                if not stopping:  # before the save: the checkpoint has the weights they scored
                    stopping = run.callbacks.evaluate(run, stop, last, lambda: _save(run))
                if stopping or run.callbacks.wants_save(run, last):  # a periodic one: callbacks.SaveEvery
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
            run.callbacks.train_end(run)
    plots = write_plots(recipe.run_dir, warn=run.warn, **run.hooks.plots()) if run.d.rank == 0 and t.plots else []
    run.callbacks.finish(run, [recipe.run_dir / p for p in plots])
    return summary(run, interrupted=bool(stop.signum), plots=plots)


# ----------------------------------------------------------------------------- one step


def _optimizer_step(run: Run, stop: Signals) -> Step:
    """grad_accum micro-batches of (micro, T) on every rank (DeepSpeed updates at the boundary),
    then ONE all-reduce of the step vector: log keys, statistics, flags (``StepPacking``)."""
    r, d, engine, pk = run.recipe, run.d, run.engine, run.packing
    t0 = time.perf_counter()
    lr = float(engine.get_lr()[0])
    nan = run.faults.nan(run.tot.step + 1)  # the tests' fault injection (ncpctl.train.faults)
    run.callbacks.step_begin(run, run.tot.step + 1)
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
    return Step(lr, red.terms, red.stats, skipped, red.flags["stop"] > 0,
                 None if grad_norm is None else float(grad_norm), seconds, attention)


def _attention_due(every: int, step: int) -> bool:
    """``train.attention_stats_every``: at step 1 (1-based; the curves start at the init) and every N-th."""
    return every > 0 and (step == 1 or step % every == 0)


def _attention_stats(run: Run, mb: torch.Tensor, mb_ids: torch.Tensor,
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


def _count_nonfinite(run: Run, step: Step) -> None:
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


def _train_record(run: Run, step: Step) -> dict[str, Any]:
    """The train record (rank 0): the loop's numbers, then the model's log keys and the step
    statistics, by name."""
    r, tot = run.recipe, run.tot
    return {"split": "train", "step": tot.step, "lr": step.lr, "tokens": tot.tokens, "grad_norm": step.grad_norm,
            "step_time": step.seconds, "tokens_per_s": r.global_batch_size * r.seq_len / step.seconds,
            "mfu": run.flops_per_step / step.seconds / run.peak, "nonfinite": tot.nonfinite_total,
            **run.packing.record(step.terms), **step.stats}


# ----------------------------------------------------------------------------- evaluate, save, finish


def _evaluate(run: Run, stop: Signals, final: bool = False) -> bool:
    """Validation on train.eval_batches fixed batches (per data.mix component when the mixture's
    components have validation splits; ``ncpctl.train.validate``), recorded (the callbacks write and
    show it). Returns whether a stop signal abandoned it (``stopping.abandon_on_stop``: nothing is
    recorded then)."""
    try:
        with abandon_on_stop(run.engine.module, stop, run.d):
            val = validate(run, final)
    except Abandoned:
        run.engine.train()
        run.info(f"validation at step {run.tot.step} abandoned: a stop signal came; saving now")
        return True
    run.tot.val, run.tot.val_step = val, run.tot.step
    if run.callbacks.records:
        run.callbacks.record(run, {"split": "val", "step": run.tot.step, **run.tot.val})
    return False


def _save(run: Run) -> None:
    """A checkpoint (collective): DeepSpeed's state plus the training state ncpctl.json records."""
    r, tot, stage = run.recipe, run.tot, run.stage
    meta = {"stage": stage.name, "tokens_seen": tot.tokens, "model_config": r.model_config.to_dict(),
            "optimizer": r.train.optimizer,
            **run.hooks.checkpoint_meta(),  # what the designs record (e.g. their label names)
            "data": {"train": run.data.loader.state_dict(),  # with data.mix: its components in the state
                     "train_prefix": None if r.data.mix and not r.data.train_prefix else str(run.data.train_ds.bin_path)[:-4]},
            "world_size": run.d.world, "zero_stage": run.zero.stage,
            "nonfinite_total": tot.nonfinite_total, "train_loss": tot.train_loss, "val": tot.val,
            "threads": threads.record(),  # the intra-op count changes the numerics (ncpctl.threads)
            "budget": r.budget.record(tot.step, tot.tokens, run.flops_per_step),
            # a decay branch's start (the concrete checkpoint, its step, the stable-phase losses): its resumes
            # and `fit` read it, also once the stable checkpoint is pruned (ncpctl.recipe.length.decay_start)
            "decay_from": r.decay_start,
            "train_loss_step": tot.train_loss_step, "val_step": tot.val_step,
            "init_from": str(stage.init_from) if stage.init_from else None}
    if r.train.lora is not None and stage.name == "midtrain":
        meta["lora"] = describe(r.train.lora)  # model.safetensors holds the adapters merged in
    tot.last_good = ckpt.save(run.engine, run.root, tot.step, meta, r, rank=run.d.rank,
                              keep_last=r.train.keep_last, barrier=run.d.barrier, fault=run.faults)
    tot.last_saved = tot.step
    run.info(f"[dim]saved {tot.last_good}[/]")
