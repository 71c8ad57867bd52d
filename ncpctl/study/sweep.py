"""Sweeps: one base recipe, many points, each an ordinary child recipe run by ``ncpctl pretrain``.

The sweep file (YAML)::

    name: dlcm-grid                  # default: the file's stem
    base: ../dlcm-2.3b.yaml          # the base recipe, relative to the sweep file
    out: runs/sweeps/dlcm-grid       # default runs/sweeps/NAME, relative to the working directory (as run.dir)
    ranks: 1                         # > 1: each point runs under the DeepSpeed launcher (--num_gpus N)
    axes:                            # a grid: the cartesian product of these lists
      model.concept.target_ratio: [2, 4, 8]
    zip:                             # lists varied together (one more axis of the grid); all of one length
      name: [274m-p50, 468m-p50]     # optional: labels of the rows, used in the point names
      model.d_model: [768, 1024]
      model.n_heads: [12, 16]
                                     # or a list of such mappings: each one more axis (lr x width)
    points:                          # explicit points, added to the grid's (optional `name` each)
      - {name: extra, model.d_model: 512, train.max_steps: 100}
    fixed:                           # keys set for every point (they do not name points)
      train.max_steps: null          # e.g. the base's step count left out for a train.max_flops axis
    slurm:                           # --executor slurm: submitit's parameters (partition, time, nodes, ...)
      partition: gpu
      timeout_min: 1440
      gpus_per_node: 8

Every key is a recipe key path; a point sets the ``fixed`` keys and its own over the base, and each
point is checked whole (all its keys together, as pretrain will load it). At least one of ``axes``,
``zip`` and ``points`` is needed. Each point is written as ``OUT/points/NAME.yaml``, a recipe that
``extends:`` the base (by a relative path) and sets the point's keys and ``run.dir: OUT/runs/NAME``, so
``ncpctl pretrain OUT/points/NAME.yaml`` reruns it by hand; ``OUT/manifest.json`` lists the points,
their keys, recipes, run directories, FLOPs, tokens and status. A point's name is its values
(``d_model=768+target_ratio=2``; ``ncpctl.study.sweep_names``: the last part of each key, a zip row's
or a point's ``name`` for its keys, an axis of one value left out), so names are stable when points
are added. Running and resuming: ``ncpctl.study.sweep_run``; when a point counts as done:
``ncpctl.study.sweep_state``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ncpctl.errors import UserError
from ncpctl.study.sweep_names import Part, label, legacy_name, name_of

TOP_KEYS = ("name", "base", "out", "ranks", "axes", "zip", "points", "fixed", "slurm", "timeout_min")
EXECUTORS = ("local", "slurm")
MANIFEST = "manifest.json"
RUNS = "runs"  # OUT/runs/NAME: a point's run directory


@dataclass
class SweepPoint:
    name: str
    params: dict[str, Any]
    recipe: Path = Path()  # OUT/points/NAME.yaml
    run_dir: Path = Path()
    max_steps: int = 0
    flops_per_step: float = 0.0
    tokens_per_step: int = 0
    status: str = "pending"  # pending, running, done, stale, locked, failed, interrupted
    step: int = 0
    val_loss: float | None = None
    note: str = ""
    legacy: str = ""  # the name an older ncpctl gave the point (sweep_names.legacy_name)
    # the keys the base and the point set (run.dir aside), each at its resolved value (JSON): what
    # the run of a finished point must have recorded (sweep_state.stale_reason)
    expect: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params, "recipe": str(self.recipe), "run_dir": str(self.run_dir),
                "max_steps": self.max_steps, "flops_per_step": self.flops_per_step,
                "flops": self.flops_per_step * self.max_steps, "tokens_per_step": self.tokens_per_step,
                "tokens": self.tokens_per_step * self.max_steps, "status": self.status, "step": self.step,
                "val_loss": self.val_loss, "note": self.note}


@dataclass
class Sweep:
    path: Path
    name: str
    base: Path
    out: Path
    ranks: int
    keys: list[str]
    points: list[SweepPoint]
    fixed: dict[str, Any] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    timeout_min: float = 60 * 24 * 7
    notes: list[str] = field(default_factory=list)
    # how this invocation runs it (the command's flags), and how it ended
    verify: bool = False  # full checksums of each finished point's final checkpoint, not sizes alone
    break_lock: bool = False  # start points locked by another host (pretrain --break-lock)
    rerun_stale: bool = False  # move a stale point's run aside and train it again
    state: str = "planned"  # running, interrupted, done, incomplete
    signum: int = 0  # the signal that interrupted the run (0: none)
    verdicts: dict[str, str | None] = field(default_factory=dict)  # final checkpoint -> why stale (None: done)

    def manifest(self) -> dict[str, Any]:
        return {"sweep": str(self.path), "name": self.name, "base": str(self.base), "out": str(self.out),
                "ranks": self.ranks, "keys": self.keys, "fixed": self.fixed, "state": self.state,
                "points": [p.to_dict() for p in self.points]}


# ----------------------------------------------------------------------------- reading the sweep file


def _fail(path: Path, msg: str) -> UserError:
    return UserError(f"{path}: {msg}", hint="see the sweep file format in `ncpctl sweep --help` or docs/scaling.md")


def _key_list(path: Path, section: str, raw: Any) -> dict[str, list[Any]]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, f"{section}: must be a non-empty mapping of recipe key paths to lists of values")
    for key, values in raw.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise _fail(path, f"{section}: {key!r} is not a recipe key path such as model.d_model")
        if not isinstance(values, list) or not values:
            raise _fail(path, f"{section}: {key}: must be a non-empty list of values")
    return raw


def _zips(path: Path, raw: Any) -> list[dict[str, list[Any]]]:
    """``zip``: one mapping of lists varied together, or a list of them (each one more axis of the grid:
    a learning rate with its min_lr x a width with its heads)."""
    groups = raw if isinstance(raw, list) else [raw]
    out = []
    for i, g in enumerate(groups):
        where = "zip" if len(groups) == 1 else f"zip[{i}]"
        zipped = _key_list(path, where, g)
        lengths = {k: len(v) for k, v in zipped.items()}
        if len(set(lengths.values())) > 1:
            raise _fail(path, f"{where}: the lists differ in length (" + ", ".join(f"{k} {n}" for k, n in lengths.items())
                        + "); zipped keys vary together, one value each per point")
        out.append(zipped)
    return out


def _rows(path: Path, doc: dict[str, Any]) -> list[tuple[list[Part], dict[str, Any]]]:
    """(name parts, params) of every point: the grid of ``axes`` x ``zip`` rows, then ``points``."""
    axes = _key_list(path, "axes", doc["axes"]) if doc.get("axes") is not None else {}
    factors: list[list[tuple[list[Part], dict[str, Any]]]] = []
    all_keys = list(axes)
    zips = _zips(path, doc["zip"]) if doc.get("zip") is not None else []
    for zipped in zips:
        all_keys += [k for k in zipped if k != "name"]
    for key, values in axes.items():
        # a key with one value is the same for every point: it does not name them
        factors.append([([(label(key, all_keys), v)] if len(values) > 1 else [], {key: v}) for v in values])
    for j, zipped in enumerate(zips):  # zip rows first (in their order), then the axes
        names = zipped.get("name")
        keys = [k for k in zipped if k != "name"]
        n = len(next(iter(zipped.values())))
        factors.insert(j, [([(None, names[i])] if names else [(label(k, all_keys), zipped[k][i]) for k in keys],
                            {k: zipped[k][i] for k in keys}) for i in range(n)])
    rows = []
    if factors:
        for combo in itertools.product(*factors):
            params = {k: v for c in combo for k, v in c[1].items()}
            parts = [p for c in combo for p in c[0]] or [(label(k, params), v) for k, v in params.items()]
            rows.append((parts, params))
    explicit = doc.get("points")
    if explicit is not None:
        if not isinstance(explicit, list) or not explicit or not all(isinstance(p, dict) and p for p in explicit):
            raise _fail(path, "points: must be a non-empty list of mappings (recipe key path: value, optional name)")
        for i, p in enumerate(explicit):
            params = {k: v for k, v in p.items() if k != "name"}
            _key_list(path, f"points[{i}]", {k: [v] for k, v in params.items()} or None)
            named: list[Part] = [(None, p["name"])] if "name" in p else \
                [(label(k, params), v) for k, v in params.items()]
            rows.append((named, params))
    if not rows:
        raise _fail(path, "no points: give axes, zip or points (each a recipe key path with a non-empty list of values)")
    return rows


def _fixed(path: Path, doc: dict[str, Any], rows: list[tuple[list[Part], dict[str, Any]]]) -> dict[str, Any]:
    """``fixed``: keys every point sets, a value each (not a list): they name no point."""
    raw = doc.get("fixed")
    if raw is None:
        return {}
    _key_list(path, "fixed", {k: [v] for k, v in raw.items()} if isinstance(raw, dict) and raw else None)
    varied = next((k for k in raw for _, params in rows if k in params), None)
    if varied is not None:
        raise _fail(path, f"fixed: {varied} is also varied (axes, zip or points); give it in one place")
    return dict(raw)


def read_sweep(path: str | os.PathLike[str], *, out: str | None = None) -> tuple[Sweep, dict[str, Any]]:
    """The sweep's definition (points named, not yet validated against the base recipe)."""
    from ncpctl.recipe.yaml_io import alias_problem, yaml_load, yaml_problem

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: sweep file not found")
    try:
        doc = yaml_load(path.read_text())
        bad = alias_problem(doc)
    except yaml.YAMLError as e:
        raise _fail(path, f"invalid YAML ({yaml_problem(e)})") from None
    except RecursionError:
        raise _fail(path, "YAML nested too deeply") from None
    if bad is not None:
        raise _fail(path, bad)
    if not isinstance(doc, dict):
        raise _fail(path, "a sweep file must be a mapping (base, axes, zip, points, ...)")
    unknown = [k for k in doc if k not in TOP_KEYS]
    if unknown:
        raise _fail(path, f"{unknown[0]}: unknown key; a sweep has {', '.join(TOP_KEYS)}")
    if not isinstance(doc.get("base"), str) or not doc["base"]:
        raise _fail(path, "base: missing; name the base recipe (a path relative to the sweep file)")
    base = Path(os.path.normpath(doc["base"] if os.path.isabs(doc["base"]) else path.parent / doc["base"]))
    if not base.is_file():
        raise _fail(path, f"base: {doc['base']}: recipe not found ({base})")
    name = str(doc.get("name") or path.stem)
    ranks = doc.get("ranks", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise _fail(path, f"ranks: must be a positive integer, got {ranks!r}")
    slurm = doc.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise _fail(path, "slurm: must be a mapping of submitit/Slurm parameters (partition, timeout_min, ...)")
    timeout = doc.get("timeout_min", 60 * 24 * 7)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise _fail(path, f"timeout_min: must be a positive number of minutes, got {timeout!r}")
    rows = _rows(path, doc)
    fixed = _fixed(path, doc, rows)
    points, seen = [], {}
    keys: list[str] = []
    for parts, params in rows:
        pname = name_of(parts)
        if pname in seen:
            raise _fail(path, f"two points are both named {pname!r} (the same values); give them distinct names")
        seen[pname] = params
        points.append(SweepPoint(name=pname, params=params, legacy=legacy_name(parts)))
        keys += [k for k in params if k not in keys]
    o = Path(os.path.expanduser(out or str(doc.get("out") or f"runs/sweeps/{name}")))
    return Sweep(path=path, name=name, base=base, out=o, ranks=ranks, keys=keys, points=points, fixed=fixed,
                 slurm=slurm, timeout_min=float(timeout)), doc


# ----------------------------------------------------------------------------- validation and accounting


def _sets(params: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


def _problems(sweep: Sweep, p: SweepPoint, e: UserError) -> list[str]:
    """A point's load errors as the sweep's: an unknown key names the key (its axis or ``fixed``), whatever
    value it has; anything else names the point (load_recipe names a key the point sets ``--set``)."""
    lines: list[str] = []
    for line in e.problems:
        where, _, msg = line.removeprefix("--set: ").partition(": ")
        key = next((k for k in [*sweep.fixed, *p.params] if k == where or k.startswith(where + ".")), None)
        if line.startswith("--set: ") and key is not None and msg.startswith(("unknown key", "unknown section")):
            section = "fixed" if key in sweep.fixed else "axis"
            lines.append(f"{sweep.path}: {section} {key}: " + (msg if where == key else f"{where}: {msg}"))
        else:
            lines.append(f"{sweep.path}: point {p.name}: {line.removeprefix('--set: ')}")
    return list(dict.fromkeys(lines))


MISSING = "<not set>"  # a key the resolved recipe does not have


def value_at(tree: Any, key: str) -> Any:
    """The value at key path ``key`` of a resolved recipe dict (MISSING: none)."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def resolve(sweep: Sweep, *, strict: bool) -> None:
    """Load every point's recipe whole (``strict``: as pretrain will, data files included; else as
    profile-kernels does, placeholder data paths tolerated), the first that fails in one error naming
    it, and fill each point's steps, FLOPs, tokens and the values its run must record."""
    from ncpctl.profile.load import load_for_profile
    from ncpctl.recipe import load_recipe
    from ncpctl.recipe.load import set_keys

    adopt_legacy_names(sweep)
    base_keys = [k for k in set_keys(sweep.base) if k != "run.dir"]  # where a run is does not change it
    notes: set[str] = set()
    for p in sweep.points:
        sets = _sets(sweep.fixed) + _sets(p.params) + [f"run.dir={json.dumps(str(p.run_dir))}"]
        try:
            if strict:
                r = load_recipe(sweep.base, sets, world_size=sweep.ranks)
            else:
                r, found = load_for_profile(str(sweep.base), sets, world_size=sweep.ranks, drop_missing_sets=True)
                notes.update(found)
        except UserError as e:
            raise UserError(*_problems(sweep, p, e), hint=e.hint) from None
        p.max_steps = int(r.train.max_steps)
        p.flops_per_step = float(r.flops_per_step())
        p.tokens_per_step = int(r.seq_len) * int(r.global_batch_size)
        resolved = json.loads(json.dumps(r.to_dict(), default=str))
        p.expect = {k: value_at(resolved, k) for k in dict.fromkeys([*base_keys, *sweep.fixed, *p.params])}
    sweep.notes = sorted(notes)


def adopt_legacy_names(sweep: Sweep) -> None:
    """A point keeps the name an older ncpctl gave it (commas, numbers in full) when its run directory
    is there under that name and not under the new one: a finished study is recognised, not rerun."""
    for p in sweep.points:
        new = sweep.out / RUNS / p.name
        old = sweep.out / RUNS / p.legacy
        # (an old name could be ".." or too long for a file name: never one of those)
        ok = p.legacy not in (".", "..") and len(p.legacy.encode()) < 256
        if ok and p.legacy != p.name and old.is_dir() and not new.exists():
            p.name = p.legacy
        p.run_dir = sweep.out / RUNS / p.name
        p.recipe = sweep.out / "points" / f"{p.name}.yaml"


# ----------------------------------------------------------------------------- writing and state


def child_recipe(sweep: Sweep, p: SweepPoint) -> str:
    """The point's recipe: ``extends:`` the base (relative to points/) plus the point's keys."""
    tree: dict[str, Any] = {}
    for key, value in {**sweep.fixed, **p.params, "run.dir": str(p.run_dir)}.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    rel = os.path.relpath(sweep.base.resolve(), p.recipe.parent.resolve())
    head = (f"# Point {p.name} of the sweep {sweep.path} (written by `ncpctl sweep`; rerun it by hand with\n"
            f"# `ncpctl pretrain {p.recipe}`).\n")
    return head + yaml.safe_dump({"extends": rel}, sort_keys=False) + yaml.safe_dump(tree, sort_keys=False)


def write_plan(sweep: Sweep) -> None:
    from ncpctl.fsutil import atomic_write

    (sweep.out / "points").mkdir(parents=True, exist_ok=True)
    for p in sweep.points:
        text = child_recipe(sweep, p)
        if not p.recipe.is_file() or p.recipe.read_text() != text:
            atomic_write(p.recipe, text)
    write_manifest(sweep)


def write_manifest(sweep: Sweep) -> None:
    from ncpctl.fsutil import atomic_write

    atomic_write(sweep.out / MANIFEST, json.dumps(sweep.manifest(), indent=1, default=str) + "\n")
