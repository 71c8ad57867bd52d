"""What `pretrain`, `midtrain`, `adapt-vq` and `train-drafter` call: ``run_stage(StageRequest, out)``
loads the recipe, holds the run directory's lock, runs the stage and reports its summary.

Kept light (no torch import at module level) so `ncpctl --help` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from ncpctl.output import Output


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """DeepSpeed logs and prints to stdout (its logger, the op builder); stdout is reserved for
    the result (`--json`), so while it runs both Python's sys.stdout and fd 1 point at stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


@dataclass
class StageRequest:
    """A training command's arguments: the stage, the recipe file and its ``--set`` overrides."""

    stage: str  # pretrain, midtrain, adapt-vq, train-drafter
    recipe: str
    sets: list[str] = field(default_factory=list)
    break_lock: bool = False
    verify: bool = True


def run_stage(req: StageRequest, out: Output) -> None:
    """Train the request's stage; rank 0 reports the summary through ``out``."""
    from ncpctl.recipe import load_recipe
    from ncpctl.runlock import RunLock

    stage_name, r = req.stage, load_recipe(req.recipe, req.sets)
    # one writer per run.dir: rank 0 holds its lock (the launcher's other ranks run under it)
    lock = RunLock(r.run_dir, stage_name, warn=out.warn, break_lock=req.break_lock) if _rank() == 0 else None
    with lock or contextlib.nullcontext(), stdout_to_stderr():
        from ncpctl.checkpoint import set_verify
        from ncpctl.train.loop import train
        from ncpctl.train.stages import make_stage

        set_verify(req.verify)
        stage = make_stage(r, stage_name)
        summary = train(r, stage, out)
    if _rank() != 0:  # under a launcher only rank 0 reports
        return
    out.result({"command": stage_name, **summary}, lambda con: human(con, summary))


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def human(con: Any, s: dict[str, Any]) -> None:
    """The stage's summary for people (the JSON result is the summary itself)."""
    from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT

    state = "interrupted (checkpoint saved)" if s["interrupted"] else "done"
    con.print(f"{s['stage']} {state}: step {s['step']}/{s['max_steps']}, {s['tokens']:,} tokens, "
              f"{s['trainable_parameters']:,} of {s['parameters']:,} parameters trained")
    b = s.get("budget") or {}
    if b.get("kind") in ("tokens", "flops"):
        con.print(f"budget: max_{b['kind']} {b['value']:g}: {b['flops']:.4g} training FLOPs spent ({FLOP_CONVENTION_SHORT})"
                  + (f" ({b['flops_realised']:.4g} at the realised {b['tokens_per_concept']:.3g} tokens per concept)"
                     if "flops_realised" in b else ""))
    val = s["val"]
    if val.get("loss") is not None:
        from ncpctl.train.display import estimate_terms, loss_terms, term_text

        # the objective's term first (comparable across models), then the others, then the total
        terms = [term_text(val, k) for k in loss_terms(val)]
        line = f"val at step {s['val_step']}: " if s.get("val_step") is not None else "val: "
        line += ", ".join([*terms, f"total {val['loss']:.4f}"] if len(terms) > 1 else [f"loss {val['loss']:.4f}"])
        line += "".join(", " + t for t in estimate_terms(val))  # e.g. the CDLM's held-out ELBO
        if isinstance(val.get("concept_auc"), (int, float)):  # a bottleneck: held-out concept detection
            from ncpctl.train.display import detection_line

            line += ", " + detection_line(val)
        if s.get("unigram_entropy") is not None:
            line += f"; unigram entropy of the training data {s['unigram_entropy']:.4f} nats"
        con.print(line)
    if s.get("train_loss") is not None and s.get("train_loss_step") is not None:
        con.print(f"train loss at step {s['train_loss_step']}: {s['train_loss']:.4f}")
    if s.get("steps_per_s"):
        mfu, compiled = "", s.get("compile_s") is not None  # train.compile: the first step is compilation
        if s.get("mfu") is not None:
            ranks = f"{s['world_size']} ranks, each " if s.get("world_size", 1) > 1 else ""
            mfu = f", MFU {100 * s['mfu']:.1f}% (mean over {s['steps_run'] - compiled} steps, {FLOP_CONVENTION_SHORT}) " \
                  f"of {s['peak_flop_per_s'] / 1e9:,.0f} GFLOP/s ({ranks}{s['peak_source']})"
        con.print(f"{s['steps_per_s']:.2f} steps/s, {s['tokens_per_s']:,.0f} tokens/s{mfu}"
                  + (f", {s['nonfinite_steps']} non-finite steps skipped" if s["nonfinite_steps"] else "")
                  + (f"; compilation {s['compile_s']:.1f} s (the first step, not in these rates)" if compiled else ""))
    if s["checkpoint"]:
        con.print(f"checkpoint: {s['checkpoint']}")
    for p in s.get("plots") or []:
        con.print(f"plot: {s['run_dir']}/{p}")
