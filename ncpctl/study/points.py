"""The points a scaling fit reads: one trained run each, as (family, N, D, C, metrics).

Two inputs:

* a table, JSON (a list of objects, or ``{"points": [...]}``) or CSV (a header row), with the
  columns ``family`` (default ``default``), ``N`` (parameters), ``D`` (training tokens), ``C``
  (training FLOPs), optional ``name``, ``budget`` (the IsoFLOP budget a point belongs to),
  ``tokenizer`` and ``val_set`` (identities; points that differ in either are refused), the
  settings ``lr``, ``lr_token``, ``lr_concept``, ``width`` and ``concept_width`` (the muP transfer
  view's, ``ncpctl.study.transfer``), and any number of metric columns (``loss`` and others);
* run directories of ``ncpctl pretrain`` (or a directory holding them, e.g. a sweep's): N is the model's parameter count
  (``ncpctl.model.accounting.flops.count_parameters``, tied weights once), D the tokens of the last
  training record of ``metrics.jsonl``, C the exact training FLOPs of those steps
  (``Recipe.flops_per_step()`` times the steps; a dynamic segmentation's at the
  mean tokens per concept its training records logged, not at the target R), the metrics those of the last
  validation record; the run's family is ``default``, or the directory's parent name with
  ``family_from_parent`` (``runs/base/s1``, ``runs/conceptlm/s1``: families base and conceptlm; a sweep's
  point, ``OUT/runs/NAME``, is of the family ``OUT``'s name, so ``study/base`` and ``study/conceptlm``
  sweeps are two families). The tokenizer is ``data/meta.json``'s tokenizer sha256, the
  validation set its source fingerprint and split (``data.val_prefix`` when set). Its settings come
  from the resolved recipe: ``lr`` = train.lr (decoupled muP's eta_base_others), ``lr_token`` /
  ``lr_concept`` the token and concept modules' base rates (``ncpctl.train.config.base_lrs``),
  ``width`` = model.d_model and ``concept_width`` the concept transformer's d_concept. The
  columns of ``ncpctl.study.run_columns`` come with it: the non-embedding N and C, the epochs over
  the training split, a concept path's R and P, a decay branch's stable-phase losses.

Every table column a fit reads and does not treat as a metric: REQUIRED, ``family``, ``name``,
``budget``, IDENTITY and SETTINGS (the last held in ``Point.settings``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ncpctl.errors import UserError

REQUIRED = ("N", "D", "C")
IDENTITY = ("tokenizer", "val_set")
# what a run was trained with (the rates and widths), and what it cost beyond N, D and C: not metrics
SETTINGS = ("lr", "lr_token", "lr_concept", "width", "concept_width", "N_nonembedding", "C_nonembedding", "epochs")
BUDGET_TOLERANCE = 0.05  # points whose C differ by under 5% share an IsoFLOP budget (when no budget column)


@dataclass(frozen=True)
class Point:
    family: str
    N: float
    D: float
    C: float
    metrics: dict[str, float]
    name: str = ""
    budget: float | None = None
    identity: dict[str, str] = field(default_factory=dict)  # tokenizer, val_set
    settings: dict[str, float] = field(default_factory=dict)  # SETTINGS: lr, width, ...

    def column(self, name: str) -> float | None:
        """A metric or a setting (a table's R, P, stable_loss are metrics; a run directory's, settings)."""
        return self.metrics.get(name, self.settings.get(name))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "N": self.N, "D": self.D, "C": self.C,
                "budget": self.budget, **self.settings, **self.metrics, **self.identity}


def _number(v: Any, where: str, col: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UserError(f"{where}: column {col!r} is not a number: {v!r}") from None
    if not math.isfinite(x):
        raise UserError(f"{where}: column {col!r} is not finite: {v!r}")
    return x


def _point(row: dict[str, Any], where: str) -> Point:
    missing = [c for c in REQUIRED if row.get(c) in (None, "")]
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)}",
                        hint="a point needs N (parameters), D (training tokens) and C (training FLOPs)")
    vals = {c: _number(row[c], where, c) for c in REQUIRED}
    bad = [c for c, v in vals.items() if v <= 0]
    if bad:
        raise UserError(f"{where}: {', '.join(bad)} must be positive")
    skip = {"family", "name", "budget", *REQUIRED, *IDENTITY, *SETTINGS}
    metrics = {k: _number(v, where, k) for k, v in row.items() if k not in skip and v not in (None, "")}
    budget = row.get("budget")
    return Point(family=str(row.get("family") or "default"), name=str(row.get("name") or ""),
                 N=vals["N"], D=vals["D"], C=vals["C"], metrics=metrics,
                 budget=None if budget in (None, "") else _number(budget, where, "budget"),
                 identity={k: str(row[k]) for k in IDENTITY if row.get(k) not in (None, "")},
                 settings={k: _number(row[k], where, k) for k in SETTINGS if row.get(k) not in (None, "")})


def read_table(path: Path) -> list[Point]:
    """The points of a JSON or CSV table (by suffix: .json, else CSV)."""
    if not path.is_file():
        raise UserError(f"{path}: no such file or run directory")
    text = path.read_text(errors="replace")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise UserError(f"{path}: not JSON ({e})") from None
        # a list, {"points": [...]}, or a fit's own fit.json (its points under "input")
        rows = next((data[k] for k in ("points", "input") if isinstance(data.get(k), list)), None) \
            if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise UserError(f"{path}: expected a list of point objects (or {{\"points\": [...]}}, or a fit.json)")
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not set(REQUIRED) <= set(reader.fieldnames):
            raise UserError(f"{path}: a CSV table needs a header with the columns N, D and C (and family, loss, ...)")
        rows = list(reader)
        if any(None in r for r in rows):
            raise UserError(f"{path}: a row has more fields than the header")
    if not rows:
        raise UserError(f"{path}: the table has no points")
    out = []
    for i, r in enumerate(rows):
        p = _point(r, f"{path}: point {i + 1}")
        out.append(p if p.name else dataclasses.replace(p, name=f"{path.stem}[{i + 1}]"))
    return out


def _last(records: list[dict[str, Any]], split: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r.get("split") == split), None)


def _identity(run: Path, recipe: Any) -> dict[str, str]:
    meta_path = run / "data" / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    tok = (meta.get("tokenizer") or {}).get("sha256") or json.dumps(recipe.tokenizer.model_dump(mode="json"),
                                                                   sort_keys=True)
    d = recipe.data
    if d.mix and not d.train_prefix:  # validated per component, weighted
        val = json.dumps({"mix": [c.model_dump(mode="json") for c in d.mix], "sources": meta.get("source_fingerprint"),
                          "split": meta.get("split")}, sort_keys=True)
    elif d.val_prefix:
        val = f"prefix:{d.val_prefix}"
    else:
        split = meta.get("split") or {"val_fraction": d.val_fraction, "split_seed": d.split_seed}
        src = meta.get("source_fingerprint") or json.dumps([s.model_dump(mode="json") for s in d.sources])
        val = json.dumps({"sources": src, "val_fraction": split.get("val_fraction"),
                          "split_seed": split.get("split_seed")}, sort_keys=True)
    return {"tokenizer": tok, "val_set": val}


def realised_ratio(cfg: Any, recs: list[dict[str, Any]]) -> float | None:
    """A dynamic segmentation's (DLCM's) tokens per concept over its training records, their mean: its
    FLOPs are those of the concepts it made, not of the target R (None: fixed blocks, or not logged)."""
    if not (cfg.concept.enabled and cfg.law.variable_length):
        return None
    seen = [float(r["tokens_per_concept"]) for r in recs
            if r.get("split") == "train" and isinstance(r.get("tokens_per_concept"), (int, float))]
    ratio = sum(seen) / len(seen) if seen else None
    return ratio if ratio is not None and ratio > 1 else None


def family_of(run: Path) -> str:
    """A run directory's family: its parent's name; a sweep point's (``OUT/runs/NAME``, OUT holding the
    sweep's manifest) the sweep's, OUT's name: every sweep's points sit in a directory named ``runs``."""
    from ncpctl.study.sweep import MANIFEST, RUNS

    parent = run.resolve().parent
    if parent.name == RUNS and (parent.parent / MANIFEST).is_file():
        return parent.parent.name
    return parent.name


def read_run(run: Path, family_from_parent: bool = False) -> Point:
    """The point of one ``ncpctl pretrain`` run directory (see the module docstring)."""
    from ncpctl.model.accounting.flops import count_parameters
    from ncpctl.recipe.load import load_recipe
    from ncpctl.study.run_columns import run_columns
    from ncpctl.train.metrics import METRICS, records

    resolved, log = run / "recipe.resolved.yaml", run / METRICS
    recipe = load_recipe(resolved)
    recs = records(log)
    train, val = _last(recs, "train"), _last(recs, "val")
    if train is None or val is None:
        raise UserError(f"{run}: {METRICS} has no {'training' if train is None else 'validation'} record",
                        hint="a fit reads the tokens of the last training step and the last validation losses")
    cfg = recipe.model_config
    ratio = realised_ratio(cfg, recs)
    per_step = recipe.flops_per_step(realised_ratio=ratio)
    metrics = {k: float(v) for k, v in val.items() if k not in ("split", "step") and isinstance(v, (int, float))}
    family = family_of(run) if family_from_parent else "default"
    steps, params = int(train["step"]), count_parameters(cfg)
    extra = run_columns(run, recipe, params, steps, float(train["tokens"]), ratio)
    return Point(family=family, name=str(run), N=float(params.total), D=float(train["tokens"]),
                 C=float(per_step) * steps, metrics=metrics, identity=_identity(run, recipe),
                 settings={**settings(recipe), **extra})


def settings(recipe: Any) -> dict[str, float]:
    """The run's rates and widths from its resolved recipe (what the transfer view reads)."""
    from ncpctl.train.config import base_lrs

    cfg, lrs = recipe.model_config, base_lrs(recipe.train)
    out = {"lr": float(recipe.train.lr), "lr_token": float(lrs["token"]), "lr_concept": float(lrs["concept"]),
           "width": float(cfg.d_model)}
    if cfg.concept.enabled:
        out["concept_width"] = float(cfg.concept_cfg.d_model)
    return out


def is_run(path: Path) -> bool:
    return (path / "recipe.resolved.yaml").is_file() and (path / "metrics.jsonl").is_file()


def run_dirs(root: Path) -> list[Path]:
    """``root`` when it is a run directory, else the run directories at any depth below it (a sweep's),
    sorted; a run directory's own subdirectories (checkpoints, data) are not searched, nor a directory
    twice (a symlink loop)."""
    out: list[Path] = []
    seen: set[str] = set()

    def walk(d: Path) -> None:
        key = os.path.realpath(d)
        if key in seen:
            return
        seen.add(key)
        if is_run(d):
            out.append(d)
            return
        try:
            subs = sorted(p for p in d.iterdir() if p.is_dir())
        except OSError:  # unreadable: nothing found there
            return
        for sub in subs:
            walk(sub)

    walk(root)
    return out


def read_points(inputs: Iterable[str], family_from_parent: bool = False,
                found: dict[str, list[Path]] | None = None) -> list[Point]:
    """Points from tables, run directories and directories of runs (a sweep's, searched at any depth;
    ``found``, when given, gets the run directories found under each directory input), checked to
    share one tokenizer and one validation set."""
    out: list[Point] = []
    for raw in inputs:
        p = Path(raw)
        if not p.is_dir():
            out += read_table(p)
            continue
        runs = run_dirs(p)
        if not runs:
            raise UserError(f"{p}: not a run directory, and none below it (a run has recipe.resolved.yaml and "
                            "metrics.jsonl)")
        if found is not None:
            found[raw] = runs
        out += [read_run(r, family_from_parent) for r in runs]
    check_identity(out)
    return out


def where_found(root: str, runs: list[Path]) -> str:
    """One line: how many run directories were found under ``root``, in which folders."""
    if runs == [Path(root)]:
        return f"{root}: a run directory"
    by: dict[str, int] = {}
    for r in runs:
        rel = os.path.relpath(r.parent, root)
        by[rel] = by.get(rel, 0) + 1
    return f"{root}: {len(runs)} run directories, in " + ", ".join(f"{k}/ ({v})" for k, v in sorted(by.items()))


def check_identity(points: list[Point]) -> None:
    """Refuse points from different tokenizers or validation sets: their losses are not comparable."""
    for key, what in (("tokenizer", "tokenizers"), ("val_set", "validation sets")):
        seen: dict[str, str] = {}
        for p in points:
            if key in p.identity:
                seen.setdefault(p.identity[key], p.name)
        if len(seen) > 1:
            a, b = list(seen.values())[:2]
            raise UserError(f"the points mix {len(seen)} {what} ({a} and {b} differ): their losses are not comparable",
                            hint="fit runs of one tokenizer and one validation set together")


def values(points: Sequence[Point], metric: str) -> np.ndarray:
    """The metric of every point; ``1-NAME`` is the complement of NAME (a metric that rises with
    scale, an AUC or an alignment, fitted as one that falls, as the law's form needs)."""
    name = metric[2:] if metric.startswith("1-") else metric
    missing = [p.name for p in points if name not in p.metrics]
    if missing:
        known = sorted({k for p in points for k in p.metrics})
        raise UserError(f"unknown metric {name!r}: {len(missing)} point(s) lack it (first: {missing[0]})",
                        hint=f"metrics of these points: {', '.join(known) or 'none'}")
    v = np.array([p.metrics[name] for p in points], float)
    return 1.0 - v if name != metric else v


def families(points: Sequence[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.family, []).append(p)
    return out


def budgets(points: Sequence[Point]) -> list[tuple[float, list[Point]]]:
    """The IsoFLOP budgets, smallest first: the ``budget`` column where given, else the points'
    C clustered within BUDGET_TOLERANCE; each budget is named by its geometric-mean C."""
    if all(p.budget is not None for p in points):
        keyed: dict[float, list[Point]] = {}
        for p in points:
            keyed.setdefault(float(p.budget), []).append(p)  # type: ignore[arg-type]
        return sorted(keyed.items())
    groups: list[list[Point]] = []
    for p in sorted(points, key=lambda q: q.C):
        if groups and p.C <= groups[-1][0].C * (1 + BUDGET_TOLERANCE):
            groups[-1].append(p)
        else:
            groups.append([p])
    return [(float(np.exp(np.mean([np.log(q.C) for q in g]))), g) for g in groups]
