"""Where each point of a sweep stands, read from its run directory.

A point is **done** when its newest complete checkpoint is at the recipe's ``train.max_steps`` and that
checkpoint can be trusted for this sweep: its files have the sizes its ``manifest.json`` lists (with
``ncpctl sweep --verify`` also their xxh3 checksums: a full read, so an 8B study is not re-hashed on
every run), and every key the base recipe or the point sets has, in the recipe the checkpoint
recorded, the value it resolves to now (``run.dir`` aside: a moved study is the same study; a key
neither sets is not compared, so a new default elsewhere does not make every point stale). A point
that fails either is **stale**, with the reason; ``--rerun-stale`` moves its run directory to
``OUT/stale/NAME[.k]`` (never deleted) and trains it again. Checkpoints from before manifests pass the
file check unchecked, as everywhere (``ncpctl.checkpoint.problem``).

Otherwise a point is **locked** while a live process holds its run directory (``ncpctl.runlock``: host,
pid and start time; a dead owner's lock is stale and does not count), **running** while this sweep
runs it, **failed** or **interrupted** after this sweep ran it, and **pending** before.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ncpctl import manifest
from ncpctl.checkpoint import CHECKPOINTS, META, is_complete
from ncpctl.runlock import holder
from ncpctl.study.sweep import value_at

if TYPE_CHECKING:
    from ncpctl.study.sweep import Sweep, SweepPoint

STALE = "stale"  # OUT/stale/NAME[.k]: a stale point's run, moved aside before it is trained again


def final_checkpoint(run_dir: Path) -> tuple[int, Path | None]:
    """The step and directory of the run's newest complete checkpoint ((0, None): none)."""
    best: tuple[int, Path | None] = (0, None)
    for cand in (run_dir / CHECKPOINTS).glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", cand.name)
        if m and int(m.group(1)) > best[0] and cand.is_dir() and is_complete(cand):
            best = (int(m.group(1)), cand)
    return best


def finished_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint (0: none)."""
    return final_checkpoint(run_dir)[0]


def _show(v: Any) -> str:
    return json.dumps(v, default=str) if not isinstance(v, str) else v


def stale_reason(p: "SweepPoint", checkpoint: Path, *, verify: bool) -> str | None:
    """Why the point's final ``checkpoint`` does not count as its result (None: it does)."""
    if (checkpoint / manifest.MANIFEST).exists():
        problem = manifest.verify(checkpoint, sizes_only=not verify)
        if problem is not None:
            return f"final checkpoint {checkpoint.name}: {problem}"
    try:
        recorded = json.loads((checkpoint / META).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not isinstance(recorded, dict):
        return f"final checkpoint {checkpoint.name}: {META} has no recipe to compare"
    changed = [(k, value_at(recorded, k), v) for k, v in p.expect.items() if value_at(recorded, k) != v]
    if not changed:
        return None
    shown = "; ".join(f"{k}: {_show(old)} when trained, {_show(new)} now" for k, old, new in changed[:3])
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    return f"its recipe changed since it was trained: {shown}{more}"


def _verdict(sweep: "Sweep", p: "SweepPoint", checkpoint: Path) -> str | None:
    """``stale_reason``, once per checkpoint and sweep run (a full ``--verify`` reads every byte); a
    checkpoint written again at the same path (a stale point trained again) is another one."""
    try:
        st = (checkpoint / META).stat()
    except OSError:
        return stale_reason(p, checkpoint, verify=sweep.verify)
    key = f"{checkpoint.resolve()}:{st.st_ino}:{st.st_mtime_ns}"
    if key not in sweep.verdicts:
        sweep.verdicts[key] = stale_reason(p, checkpoint, verify=sweep.verify)
    return sweep.verdicts[key]


def _progress(p: "SweepPoint") -> None:
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


def refresh(sweep: "Sweep", running: Iterable[str] = ()) -> None:
    """Each point's status from its run directory (and the jobs this sweep runs)."""
    running = set(running)
    for p in sweep.points:
        _progress(p)
        done_at, checkpoint = final_checkpoint(p.run_dir)
        p.step = max(p.step, done_at)
        if p.name in running:
            p.status = "running"
        elif checkpoint is not None and p.max_steps and done_at >= p.max_steps:
            why = _verdict(sweep, p, checkpoint)
            if why is None:
                p.status, p.step = "done", max(p.step, p.max_steps)
            else:
                p.status, p.note = "stale", f"{why}; --rerun-stale trains it again"
        elif (who := holder(p.run_dir, break_lock=sweep.break_lock)) is not None:
            p.status, p.note = "locked", f"run directory in use by {who}" + (
                "" if sweep.break_lock else " (if that run is gone: --break-lock)")
        elif p.status not in ("failed", "interrupted"):
            p.status = "pending"


def move_aside(sweep: "Sweep", p: "SweepPoint") -> Path:
    """Move a stale point's run directory to ``OUT/stale/NAME[.k]`` (never deleted) and forget its progress."""
    target, k = sweep.out / STALE / p.name, 1
    while target.exists():
        target, k = sweep.out / STALE / f"{p.name}.{k}", k + 1
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(p.run_dir, target)
    p.step, p.val_loss, p.status = 0, None, "pending"
    return target
