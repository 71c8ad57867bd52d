"""The ``--json`` summary of a training run (``train`` returns it; ``ncpctl pretrain`` prints it):
what ran, every figure with the step it was measured at, the rates and MFU over a stated peak, the
budget and what was spent. ``run`` is the loop's ``_Run``."""

from __future__ import annotations

import time
from typing import Any

from ncpctl import threads
from ncpctl.model.accounting.flops import FLOP_CONVENTION


def summary(run: Any, *, interrupted: bool, plots: list[str]) -> dict[str, Any]:
    r, tot, stage = run.recipe, run.tot, run.stage
    elapsed = time.perf_counter() - run.started
    steps, compute_s = run.rates.steps, run.rates.compute_s  # without a compiling first step (train.compile)
    tokens_per_step = r.global_batch_size * r.seq_len
    return {
        "stage": stage.name, "run_dir": str(r.run_dir), "step": tot.step, "max_steps": r.train.max_steps,
        "tokens": tot.tokens, "train_loss": tot.train_loss, "train_loss_step": tot.train_loss_step,
        "val": tot.val, "val_step": tot.val_step,
        "downstream": tot.downstream or None,  # train.eval_tasks: the last in-loop record
        "unigram_entropy": run.entropy, "parameters": run.n_params, "trainable_parameters": run.n_trainable,
        "steps_run": tot.step - run.first_step, "seconds": round(elapsed, 2),
        "compile_s": run.rates.compile_s,  # train.compile: the first step, compilation included
        "steps_per_s": steps / compute_s if compute_s else None,
        "tokens_per_s": steps * tokens_per_step / compute_s if compute_s else None,
        # the live MFU's definition (training FLOPs / step time / peak) over every step this process ran
        "mfu": run.flops_per_step * steps / compute_s / run.peak if compute_s else None,
        "flop_convention": FLOP_CONVENTION,  # of the MFU and the budget's FLOPs
        "peak_flop_per_s": run.peak, "peak_source": run.peak_source,
        "nonfinite_steps": tot.nonfinite_total, "interrupted": interrupted,
        "checkpoint": str(tot.last_good) if tot.last_good else None,
        "resumed_from": str(run.resume_from) if run.resume_from else None,
        "init_from": str(stage.init_from) if stage.init_from else None,
        "world_size": run.d.world, "zero_stage": r.deepspeed.zero_stage, "bf16": run.bf16,
        "threads": threads.record(),  # the intra-op count changes the numerics (ncpctl.threads)
        "budget": _budget(run),
        "plots": plots,
    }


def _budget(run: Any) -> dict[str, Any]:
    """The summary's ``budget``: the checkpoint's record, and for a learned segmentation (DLCM) the
    FLOPs at the tokens per concept its training records realised (their mean, as ``ncpctl fit``
    counts them) beside the FLOPs planned at the target R."""
    r, tot = run.recipe, run.tot
    out = r.budget.record(tot.step, tot.tokens, run.flops_per_step)
    cfg = r.model_config
    if run.d.rank == 0 and cfg.concept.enabled and cfg.law.variable_length:
        from ncpctl.study.points import realised_ratio
        from ncpctl.train.metrics import METRICS, records

        ratio = realised_ratio(cfg, records(r.run_dir / METRICS)) if (r.run_dir / METRICS).is_file() else None
        if ratio is not None:
            out["tokens_per_concept"] = ratio
            from ncpctl.train.loop import flops_per_step

            out["flops_realised"] = tot.step * flops_per_step(r, run.stage, run.engine.module, realised_ratio=ratio)
    return out
