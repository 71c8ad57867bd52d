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
    slurm:                           # --executor slurm: submitit's parameters (partition, time, nodes, ...)
      partition: gpu
      timeout_min: 1440
      gpus_per_node: 8

Every key is a recipe key path; a point sets its keys over the base. At least one of ``axes``,
``zip`` and ``points`` is needed. Each point is written as ``OUT/points/NAME.yaml``, a recipe that
``extends:`` the base (by a relative path) and sets the point's keys and ``run.dir:
OUT/runs/NAME``, so ``ncpctl pretrain OUT/points/NAME.yaml`` reruns it by hand; ``OUT/manifest.json``
lists the points, their keys, recipes, run directories, FLOPs, tokens and status. A point's name is
its values (``d_model=768,target_ratio=2``, the last part of each key; a zip row's or a point's
``name`` stands for its keys; an axis of one value is left out), so names are stable when points are
added.

Running goes through submitit, one code path for both executors: ``local`` (its LocalExecutor, at most
``parallel`` points at a time on this machine) and ``slurm`` (its AutoExecutor, one job array, at most
``parallel`` array tasks at a time). Each job runs ``ncpctl pretrain OUT/points/NAME.yaml`` as a
subprocess. A point is finished when its run directory's newest complete checkpoint is at the recipe's
``train.max_steps``; a rerun skips those, resumes the others from their checkpoints (pretrain's
``train.resume: auto``) and never starts a point whose run directory is locked by a live process.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from ncpctl.errors import UserError

TOP_KEYS = ("name", "base", "out", "ranks", "axes", "zip", "points", "slurm", "timeout_min")
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
    status: str = "pending"
    step: int = 0
    val_loss: float | None = None
    note: str = ""

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
    slurm: dict[str, Any] = field(default_factory=dict)
    timeout_min: float = 60 * 24 * 7
    notes: list[str] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        return {"sweep": str(self.path), "name": self.name, "base": str(self.base), "out": str(self.out),
                "ranks": self.ranks, "keys": self.keys, "points": [p.to_dict() for p in self.points]}


# ----------------------------------------------------------------------------- reading the sweep file


def _fail(path: Path, msg: str) -> UserError:
    return UserError(f"{path}: {msg}", hint="see the sweep file format in `ncpctl sweep --help` or the README")


def _key_list(path: Path, section: str, raw: Any) -> dict[str, list[Any]]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, f"{section}: must be a non-empty mapping of recipe key paths to lists of values")
    for key, values in raw.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise _fail(path, f"{section}: {key!r} is not a recipe key path such as model.d_model")
        if not isinstance(values, list) or not values:
            raise _fail(path, f"{section}: {key}: must be a non-empty list of values")
    return raw


def _label(key: str, keys: Iterable[str]) -> str:
    """The short name of ``key`` in point names: its last part, unless another key ends the same."""
    last = key.rsplit(".", 1)[-1]
    return key if sum(k.rsplit(".", 1)[-1] == last for k in keys) > 1 else last


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else str(v)


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text).strip("_")
    return slug if slug.strip(".") else "point"  # "." and ".." would name OUT/runs itself, or OUT


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


def _rows(path: Path, doc: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
    """(name parts, params) of every point: the grid of ``axes`` x ``zip`` rows, then ``points``."""
    axes = _key_list(path, "axes", doc["axes"]) if doc.get("axes") is not None else {}
    factors: list[list[tuple[list[str], dict[str, Any]]]] = []
    all_keys = list(axes)
    zips = _zips(path, doc["zip"]) if doc.get("zip") is not None else []
    for zipped in zips:
        all_keys += [k for k in zipped if k != "name"]
    for key, values in axes.items():
        # a key with one value is the same for every point: it does not name them
        factors.append([([f"{_label(key, all_keys)}={_fmt(v)}"] if len(values) > 1 else [], {key: v}) for v in values])
    for j, zipped in enumerate(zips):  # zip rows first (in their order), then the axes
        names = zipped.get("name")
        keys = [k for k in zipped if k != "name"]
        n = len(next(iter(zipped.values())))
        factors.insert(j, [([str(names[i])] if names else [f"{_label(k, all_keys)}={_fmt(zipped[k][i])}" for k in keys],
                            {k: zipped[k][i] for k in keys}) for i in range(n)])
    rows = []
    if factors:
        for combo in itertools.product(*factors):
            params = {k: v for c in combo for k, v in c[1].items()}
            parts = [p for c in combo for p in c[0]] or [f"{_label(k, params)}={_fmt(v)}" for k, v in params.items()]
            rows.append((parts, params))
    explicit = doc.get("points")
    if explicit is not None:
        if not isinstance(explicit, list) or not explicit or not all(isinstance(p, dict) and p for p in explicit):
            raise _fail(path, "points: must be a non-empty list of mappings (recipe key path: value, optional name)")
        for i, p in enumerate(explicit):
            params = {k: v for k, v in p.items() if k != "name"}
            _key_list(path, f"points[{i}]", {k: [v] for k, v in params.items()} or None)
            name = [str(p["name"])] if "name" in p else [f"{_label(k, params)}={_fmt(v)}" for k, v in params.items()]
            rows.append((name, params))
    if not rows:
        raise _fail(path, "no points: give axes, zip or points (each a recipe key path with a non-empty list of values)")
    return rows


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
    points, seen = [], {}
    keys: list[str] = []
    for parts, params in rows:
        pname = _slug(",".join(parts))
        if pname in seen:
            raise _fail(path, f"two points are both named {pname!r} (the same values); give them distinct names")
        seen[pname] = params
        points.append(SweepPoint(name=pname, params=params))
        keys += [k for k in params if k not in keys]
    o = Path(os.path.expanduser(out or str(doc.get("out") or f"runs/sweeps/{name}")))
    return Sweep(path=path, name=name, base=base, out=o, ranks=ranks, keys=keys, points=points, slurm=slurm,
                 timeout_min=float(timeout)), doc


# ----------------------------------------------------------------------------- validation and accounting


def _sets(params: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


def _check_keys(sweep: Sweep) -> None:
    """Each key once against the base recipe (its first value): an unknown key names the axis."""
    from ncpctl.profile.load import load_for_profile

    first: dict[str, Any] = {}
    for p in sweep.points:
        for k, v in p.params.items():
            first.setdefault(k, v)
    for key, value in first.items():
        try:
            load_for_profile(str(sweep.base), _sets({key: value}), drop_missing_sets=True)
        except UserError as e:
            for line in e.problems:  # load_recipe names the key (or the part of it that fails) after --set:
                where, _, msg = line.removeprefix("--set: ").partition(": ")
                if line.startswith("--set: ") and (key == where or key.startswith(where + ".")):
                    raise UserError(f"{sweep.path}: axis {key}: " + (msg if where == key else f"{where}: {msg}"),
                                    hint=f"a sweep key is a key path of the recipe {sweep.base}") from None


def resolve(sweep: Sweep, *, strict: bool) -> None:
    """Load every point's recipe (``strict``: as pretrain will, data files included; else as
    profile-kernels does, placeholder data paths tolerated) and fill its steps, FLOPs and tokens."""
    from ncpctl.profile.load import load_for_profile
    from ncpctl.recipe import load_recipe

    _check_keys(sweep)
    notes: set[str] = set()
    for p in sweep.points:
        p.run_dir = sweep.out / RUNS / p.name
        p.recipe = sweep.out / "points" / f"{p.name}.yaml"
        sets = _sets(p.params) + [f"run.dir={json.dumps(str(p.run_dir))}"]
        try:
            if strict:
                r = load_recipe(sweep.base, sets, world_size=sweep.ranks)
            else:
                r, found = load_for_profile(str(sweep.base), sets, world_size=sweep.ranks, drop_missing_sets=True)
                notes.update(found)
        except UserError as e:
            # a key the point sets reads as the sweep's (load_recipe names it --set)
            raise UserError(*(f"{sweep.path}: point {p.name}: {line.removeprefix('--set: ')}" for line in e.problems),
                            hint=e.hint) from None
        p.max_steps = int(r.train.max_steps)
        p.flops_per_step = float(r.flops_per_step())
        p.tokens_per_step = int(r.seq_len) * int(r.global_batch_size)
    sweep.notes = sorted(notes)


# ----------------------------------------------------------------------------- writing and state


def child_recipe(sweep: Sweep, p: SweepPoint) -> str:
    """The point's recipe: ``extends:`` the base (relative to points/) plus the point's keys."""
    tree: dict[str, Any] = {}
    for key, value in {**p.params, "run.dir": str(p.run_dir)}.items():
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


def finished_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint (0: none)."""
    from ncpctl.checkpoint import CHECKPOINTS, is_complete

    best = 0
    for cand in (run_dir / CHECKPOINTS).glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", cand.name)
        if m and int(m.group(1)) > best and cand.is_dir() and is_complete(cand):
            best = int(m.group(1))
    return best


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock (a live process), or None."""
    from ncpctl.runlock import holder

    return holder(run_dir)


def _progress(p: SweepPoint) -> None:
    """The point's step and last validation loss from its metrics.jsonl."""
    path = p.run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("split") == "train" and isinstance(rec.get("step"), int):
            p.step = max(p.step, rec["step"])
        elif rec.get("split") == "val" and isinstance(rec.get("loss"), (int, float)):
            p.val_loss = float(rec["loss"])


def refresh(sweep: Sweep, running: Iterable[str] = ()) -> None:
    """Each point's status from its run directory (and the jobs this sweep runs)."""
    running = set(running)
    for p in sweep.points:
        _progress(p)
        done_at = finished_step(p.run_dir)
        p.step = max(p.step, done_at)
        if p.name in running:
            p.status = "running"
        elif p.max_steps and done_at >= p.max_steps:
            p.status, p.step = "done", max(p.step, p.max_steps)
        elif (who := lock_holder(p.run_dir)) is not None:
            p.status, p.note = "locked", f"run directory in use by {who}"
        elif p.status not in ("failed",):
            p.status = "pending"


# ----------------------------------------------------------------------------- running


def point_command(recipe: Path, ranks: int) -> list[str]:
    """``ncpctl pretrain RECIPE --json``, under ``deepspeed --num_gpus N`` when the sweep has ranks > 1."""
    script = Path(sys.executable).parent / "ncpctl"
    ncpctl = [str(script)] if script.exists() else [sys.executable, "-m", "ncpctl"]
    if ranks > 1:
        launcher = Path(sys.executable).parent / "deepspeed"
        if not script.exists():
            raise UserError("ranks > 1 needs the installed ncpctl script next to the interpreter (the launcher runs it)")
        # --master_port 0: run_point picks a free port, so points sharing a machine do not collide
        return [str(launcher if launcher.exists() else "deepspeed"), "--num_gpus", str(ranks), "--master_port", "0",
                str(script), "pretrain", str(recipe), "--json"]
    return [*ncpctl, "pretrain", str(recipe), "--json"]


def run_point(command: list[str], cwd: str, log: str) -> dict[str, Any]:
    """The job submitit runs: the point's pretrain as a subprocess; its exit code and summary.
    An interrupt (submitit's cancel, Ctrl-C) goes on to pretrain, which saves and exits."""
    import signal
    import socket

    if "--master_port" in command and command[command.index("--master_port") + 1] == "0":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            command = [*command]
            command[command.index("--master_port") + 1] = str(sock.getsockname()[1])
    with open(log, "a") as err:
        proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            stdout, _ = proc.communicate()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            stdout, _ = proc.communicate()
    summary = None
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("{"):
            try:
                summary = json.loads(line)
            except ValueError:
                continue
            break
    return {"returncode": proc.returncode, "summary": summary}


def make_executor(kind: str, sweep: Sweep, parallel: int) -> Any:
    import submitit

    folder = sweep.out / "submitit"
    if kind == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=sweep.timeout_min)
        return ex
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise UserError(f"--executor slurm: {' and '.join(missing)} not found on PATH (not a Slurm cluster)",
                        hint="run the sweep on the cluster's login node, or use --executor local")
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params = dict(sweep.slurm)
    generic = {"timeout_min", "nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem_gb", "name",
               "stderr_to_stdout"}
    kw = {k if k in generic else f"slurm_{k}": v for k, v in params.items()}
    kw.setdefault("timeout_min", max(1, round(sweep.timeout_min)))
    kw.setdefault("tasks_per_node", 1)  # the launcher (ranks > 1) starts the ranks itself
    kw.setdefault("gpus_per_node", sweep.ranks)
    kw.setdefault("name", f"ncpctl-sweep-{sweep.name}")
    kw["slurm_array_parallelism"] = parallel
    try:
        ex.update_parameters(**kw)
    except (ValueError, TypeError, NameError, AssertionError) as e:  # submitit asserts the parameters' types
        raise UserError(f"{sweep.path}: slurm: {str(e).splitlines()[0]}") from None
    return ex


def run(sweep: Sweep, executor: str, parallel: int, show: Callable[[Sweep], None],
        interval: float = 1.0) -> None:
    """Run every point that is not done or locked, at most ``parallel`` at a time, through submitit."""
    ex = make_executor(executor, sweep, parallel)
    refresh(sweep)
    for p in sweep.points:
        if p.status == "done":
            p.note = "finished before this run: skipped"
    todo = [p for p in sweep.points if p.status in ("pending", "failed")]
    for p in todo:
        p.status, p.note = "pending", ""
    jobs: dict[str, Any] = {}
    by_name = {p.name: p for p in sweep.points}
    cwd = os.getcwd()
    logs = sweep.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def submit(p: SweepPoint) -> Any:
        return ex.submit(run_point, point_command(p.recipe, sweep.ranks), cwd, str(logs / f"{p.name}.log"))

    try:
        if executor == "slurm":  # one job array; the array's parallelism throttles it
            with ex.batch():
                pending = [(p, submit(p)) for p in todo]
            jobs = {p.name: j for p, j in pending}
            todo = []
        while todo or jobs:
            while todo and len(jobs) < parallel:
                p = todo.pop(0)
                refresh(sweep, jobs)  # a point locked since the sweep started is not started
                if p.status in ("done", "locked"):
                    continue
                jobs[p.name] = submit(p)
            for name in [n for n, j in jobs.items() if j.done()]:
                _finish(by_name[name], jobs.pop(name))
            refresh(sweep, jobs)
            write_manifest(sweep)
            show(sweep)
            if todo or jobs:
                time.sleep(interval)
    except KeyboardInterrupt:
        for j in jobs.values():
            j.cancel()
        raise
    refresh(sweep)
    write_manifest(sweep)
    show(sweep)


def _finish(p: SweepPoint, job: Any) -> None:
    try:
        res = job.result()
    except Exception as e:  # the job itself failed (submitit reports the worker's error)
        p.status, p.note = "failed", f"job failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        return
    rc, summary = res["returncode"], res.get("summary") or {}
    if rc == 0 and summary.get("interrupted"):
        p.status, p.note = "failed", "interrupted (checkpoint saved); rerun the sweep to resume"
    elif rc != 0:
        errs = "; ".join(summary.get("errors") or []) if isinstance(summary, dict) else ""
        p.status, p.note = "failed", f"pretrain exited {rc}" + (f": {errs}" if errs else "") + \
            f" (log: {p.run_dir.parents[1] / 'logs' / (p.name + '.log')})"
    elif summary.get("resumed_from"):
        p.note = f"resumed from {Path(summary['resumed_from']).name}"

