"""A run's length and the train section's cross-field checks, for the recipe loader (load.py):
the batch arithmetic, which of ``train.max_steps`` / ``max_tokens`` / ``max_flops`` fixes the number of
optimizer steps (``Budget``: floor(budget / one step's tokens or exact training FLOPs)), the warmup, the
WSD schedule's decay and its decay branches (``train.decay_from``), the learning rates."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ncpctl.errors import UserError
from ncpctl.model.core.config import ModelConfig

Problem = tuple[str, str]  # (key path, message)

DEFAULT_MAX_STEPS = 100  # train.max_steps when no key gives the run's length
BUDGET_KEYS = {"max_steps": "steps", "max_tokens": "tokens", "max_flops": "flops"}  # key -> budget kind


@dataclass
class Budget:
    """What fixes a run's length: ``kind`` steps | tokens | flops, its ``value`` (train.max_steps /
    max_tokens / max_flops) and the cost of one optimizer step in that unit (``per_step``: 1, tokens,
    training FLOPs), from which ``max_steps = floor(value / per_step)``."""

    kind: str = "steps"
    value: float = DEFAULT_MAX_STEPS
    per_step: int = 1

    @property
    def key(self) -> str:
        return next(k for k, kind in BUDGET_KEYS.items() if kind == self.kind)

    @property
    def max_steps(self) -> int:
        from fractions import Fraction

        return math.floor(Fraction(self.value) / self.per_step)  # exact for a float budget of any size

    def record(self, steps: int, tokens: int, flops_per_step: int) -> dict[str, Any]:
        """The ``budget`` entry of a checkpoint's metadata and the ``--json`` summary after ``steps``
        steps: the budget, the resolved max_steps, and what was spent (FLOPs = steps x the accounting)."""
        return {"kind": self.kind, "value": self.value, "max_steps": self.max_steps,
                "flops": steps * flops_per_step, "tokens": tokens}



def warmup_steps(steps: int | None, fraction: float, max_steps: int) -> int:
    """The warmup in steps: ``train.warmup_steps`` when set, else ``warmup_fraction`` of ``max_steps``."""
    return steps if steps is not None else int(round(fraction * max_steps))


def _no_concept_fits(cfg: Any, seq: int) -> tuple[str, str]:
    """The problem of a segmentation that closes no concept in train.seq_len tokens."""
    from ncpctl.model.core.config import segmentation_law

    c = cfg.concept
    key = segmentation_law(c.segmentation).length_key
    if key is not None:
        return f"model.concept.{key}", f"{getattr(c, key)} is longer than train.seq_len={seq}: no concept block fits"
    return "model.concept.segmentation", f"{c.segmentation!r} gives no concept in train.seq_len={seq} tokens"


def _check_mup_lrs(train: Any, cfg: ModelConfig | None) -> list[Problem]:
    """``train.mup_lr_token`` / ``mup_lr_concept`` are the base rates of decoupled muP's groups:
    without muP there are no such groups, and every matrix takes train.lr."""
    if cfg is None or cfg.mup_base_width is not None:
        return []
    return [(f"train.{k}", "decoupled muP is off (model.mup_base_width: null): every weight trains at train.lr; "
             "set model.mup_base_width or drop this key") for k in ("mup_lr_token", "mup_lr_concept")
            if getattr(train, k) is not None]


def _resolve_budget(train: Any, cfg: ModelConfig | None, seq: int | None, batch: int,
                    derived: dict[str, Any]) -> list[Problem]:
    """train.max_steps from whichever of max_steps / max_tokens / max_flops is set (at most one):
    floor(budget / the cost of one optimizer step), tokens = global batch x seq_len, FLOPs = the exact
    training accounting with every weight trained (``Recipe.set_step_cost`` re-resolves for a stage that
    freezes some). Sets ``train.max_steps`` and ``derived["budget"]``."""
    given = [k for k in BUDGET_KEYS if getattr(train, k) is not None]
    if len(given) > 1:
        train.max_steps = train.max_steps or DEFAULT_MAX_STEPS  # the other checks still run
        return [(f"train.{given[-1]}", f"set together with {' and '.join('train.' + k for k in given[:-1])}: "
                 "exactly one of train.max_steps, max_tokens, max_flops gives the run's length "
                 "(set the others to null)")]
    key = given[0] if given else "max_steps"
    value = getattr(train, key) if given else DEFAULT_MAX_STEPS
    if key == "max_steps":
        per, unit = 1, ""
    elif seq is None or (key == "max_flops" and cfg is None):
        train.max_steps = train.max_steps or DEFAULT_MAX_STEPS  # the other checks still run
        return []  # the model or the sequence length is wrong already (reported)
    elif key == "max_tokens":
        per, unit = batch * seq, f" tokens = global_batch_size {batch} x seq_len {seq}"
    else:
        from ncpctl.model.accounting.flops import training_flops_per_step

        per = training_flops_per_step(cfg, seq, batch)
        unit = f" training FLOPs, attention counted in full, at global_batch_size {batch} x seq_len {seq}"
    budget = derived["budget"] = Budget(BUDGET_KEYS[key], value, per)
    steps = budget.max_steps
    train.max_steps = max(1, min(steps, 2**53))  # so that the other checks still run
    if steps < 1:
        return [(f"train.{key}", f"{value:g} is smaller than one optimizer step ({per:,}{unit})")]
    if steps > 2**53:
        return [(f"train.{key}", f"{value:g} is {steps:,} optimizer steps, more than 2**53")]
    return []


def _resolve_wsd(train: Any, warm: int, derived: dict[str, Any], run_dir: Path | None) -> list[Problem]:
    """``train.schedule: wsd``: the decay's length (``derived["decay_steps"]``), and for a decay branch
    (``train.decay_from``) max_steps = the checkpoint's step + train.decay_steps."""
    wsd_keys = [k for k in ("decay_steps", "decay_from") if getattr(train, k) is not None]
    if train.schedule != "wsd":
        return [(f"train.{k}", f"applies to train.schedule: wsd (this recipe's schedule is {train.schedule})")
                for k in wsd_keys]
    problems: list[Problem] = []
    if train.decay_from is not None:
        problems += [(f"train.{k}", "a decay branch (train.decay_from) runs from its checkpoint's step for "
                      "train.decay_steps; drop this budget") for k in ("max_tokens", "max_flops") if getattr(train, k)]
        if train.decay_steps is None:
            problems.append(("train.decay_steps", "train.decay_from runs only the decay phase: give its length in steps"))
        if train.resume != "auto":
            problems.append(("train.resume", f"{train.resume}: a decay branch starts from train.decay_from (and "
                             "continues its own checkpoints); use resume: auto"))
        start, problem = decay_start(train.decay_from, run_dir)
        if problem is not None:
            problems.append(("train.decay_from", problem))
        if problems:
            return problems
        derived["decay_start"] = start
        train.max_steps = int(start["step"]) + train.decay_steps
        derived["budget"] = Budget("steps", train.max_steps, 1)
        warm = derived["warmup_steps"] = warmup_steps(train.warmup_steps, train.warmup_fraction, train.max_steps)
    decay = train.decay_steps if train.decay_steps is not None else max(1, round(train.decay_fraction * train.max_steps))
    derived["decay_steps"] = decay
    if warm + decay > train.max_steps:
        what = "the branch's warmup" if train.decay_from else "warmup"
        problems.append(("train.decay_steps", f"{what} {warm} + decay {decay} steps exceed train.max_steps="
                         f"{train.max_steps}: no room for the stable phase"))
    return problems


def decay_start(spec: str, run_dir: Path | None) -> tuple[dict[str, Any], str | None]:
    """Where a decay branch starts: ``{"spec", "path", "step", "val"}`` (the concrete checkpoint, its step,
    its validation losses when it validated at that step: the stable-phase loss), or why not.

    Once the branch has checkpoints of its own, the start they recorded, always: a run-directory spec
    would otherwise resolve to the stable run's newest checkpoint, which moves on as that run goes on,
    and so would the branch's schedule. A spec that no longer names the recorded start is refused."""
    from ncpctl.checkpoint import CHECKPOINTS, read_meta, resolve

    if run_dir is not None and (run_dir / CHECKPOINTS).is_dir():
        try:
            recorded = read_meta(resolve(run_dir, pin_it=False))["decay_from"]
            step = int(recorded["step"])
        except (UserError, KeyError, TypeError, ValueError):
            recorded = None  # no checkpoint of its own yet (or one without the record): resolve the spec
        if recorded is not None:
            path = str(recorded.get("path"))
            if not _names(spec, path):
                return {}, (f"{spec} does not name this branch's start, {path} (step {step}), which its checkpoints "
                            f"in {run_dir / CHECKPOINTS} continue; set train.decay_from back to it, or start the new "
                            "branch in a run directory of its own")
            return {"spec": spec, "path": path, "step": step, "val": recorded.get("val")}, None
    return _stable_checkpoint(spec, run_dir)


def _names(spec: str, path: str) -> bool:
    """Does ``spec`` (a checkpoint, its ``checkpoints/`` directory or its run directory) name ``path``?"""
    from ncpctl.checkpoint import run_dir_of

    target = Path(os.path.abspath(path))
    return os.path.abspath(spec) in {str(target), str(target.parent), str(run_dir_of(target))}


def _stable_checkpoint(spec: str, run_dir: Path | None) -> tuple[dict[str, Any], str | None]:
    """The start of a new decay branch: ``train.decay_from`` resolved to one concrete checkpoint (a run
    directory to its newest), or why it cannot start one: it must be a WSD run's (another run
    directory's), after its warmup and at or before the step its decay starts."""
    from ncpctl.checkpoint import read_meta, resolve, run_dir_of

    try:
        path = resolve(spec, pin_it=False)
        if run_dir is not None and run_dir_of(path.resolve()) == run_dir.resolve():
            return {}, (f"{path} is a checkpoint of this recipe's run.dir; a decay branch writes a run directory "
                        "of its own (set run.dir or run.name)")
        meta = read_meta(path)
        tree = yaml.safe_load((path / "recipe.resolved.yaml").read_text())
        rec = tree["train"]
        step = int(meta["step"])
        total = rec.get("max_steps") or (meta.get("budget") or {}).get("max_steps")
        schedule = rec.get("schedule", "cosine")
        if schedule != "wsd":
            return {}, f"{path}: a train.schedule: {schedule} run's checkpoint; a decay branch starts from the stable phase of a wsd run"
        stable_end, warm = int(total) - int(rec["decay_steps"]), int(rec["warmup_steps"])
    except UserError as e:
        return {}, e.problems[0]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        return {}, f"{spec}: cannot read the checkpoint's step and schedule ({type(e).__name__}: {e})"
    if step > stable_end:
        return {}, (f"{path}: step {step} is past its run's stable phase (the decay starts at step {stable_end}); "
                    "branch from a checkpoint at or before it")
    if step < warm:
        return {}, f"{path}: step {step} is inside its run's warmup ({warm} steps); branch from the stable phase"
    val = meta.get("val") if meta.get("val_step") == step else None  # the stable-phase loss, when measured there
    return {"spec": spec, "path": str(path), "step": step, "val": val or None}, None


def check_train(train: Any, cfg: ModelConfig | None, world_size: int, derived: dict[str, Any]) -> list[Problem]:
    """The train section against the model: sequence length, batch arithmetic (``derived``: seq_len,
    grad_accum_steps, global_batch_size), the run's length, warmup and schedule, the rates, the
    checkpoints it names."""
    problems: list[Problem] = []
    seq = train.seq_len or (cfg.max_seq_len if cfg else None)
    if seq is not None:
        derived["seq_len"] = seq
    if cfg is not None and seq is not None:
        problems += cfg.seq_len_problems(seq)
        if seq > cfg.max_seq_len:
            problems.append(("train.seq_len", f"{seq} exceeds model.max_seq_len={cfg.max_seq_len}"))
        if cfg.concept.enabled and cfg.num_concepts(seq) == 0:
            problems.append(_no_concept_fits(cfg, seq))
    micro, accum, glob_bs = train.micro_batch_size, train.grad_accum_steps, train.global_batch_size
    if glob_bs is None:
        accum = accum or 1
        glob_bs = micro * accum * world_size
    elif accum is None:
        if glob_bs % (micro * world_size):
            problems.append(("train.global_batch_size",
                             f"{glob_bs} is not divisible by micro_batch_size x world size = {micro} x {world_size}"))
        accum = max(1, glob_bs // (micro * world_size))
    elif micro * accum * world_size != glob_bs:
        problems.append(("train.global_batch_size",
                         f"{glob_bs} != micro_batch_size x grad_accum_steps x world size = "
                         f"{micro} x {accum} x {world_size} = {micro * accum * world_size}"))
    derived.update(grad_accum_steps=accum, global_batch_size=glob_bs)
    budget_problems = _resolve_budget(train, cfg, seq, glob_bs, derived)
    problems += budget_problems
    if train.min_lr > train.lr:
        problems.append(("train.min_lr", f"{train.min_lr} is above train.lr={train.lr}"))
    warm = warmup_steps(train.warmup_steps, train.warmup_fraction, train.max_steps)
    if warm > train.max_steps and not budget_problems:  # (a budget below one step: reported already)
        problems.append(("train.warmup_steps", f"{warm} exceeds train.max_steps={train.max_steps}"))
    derived["warmup_steps"] = warm
    if not budget_problems:
        problems += _resolve_wsd(train, warm, derived, derived.get("run_dir"))
    problems += _check_mup_lrs(train, cfg)
    if train.resume not in ("auto", "never") and not Path(train.resume).exists():
        problems.append(("train.resume", f"checkpoint not found: {train.resume} (or use auto / never)"))
    if train.init_from and not Path(train.init_from).exists():
        problems.append(("train.init_from", f"checkpoint not found: {train.init_from}"))
    if train.eval_tasks:  # before training starts, not at the first in-loop evaluation
        from ncpctl.evaluate.run import unknown_tasks

        problems += [("train.eval_tasks", line) for line in unknown_tasks(list(train.eval_tasks))]
    return problems
