"""What ``ncpctl sweep`` calls: ``run_sweep(SweepRequest, out)`` reads and resolves the sweep
(``sweep``), lists it (``--dry``) or writes its plan and runs its points through submitit
(``sweep_run``) with a progress table, and returns a ``SweepFailure`` when points did not finish
(the CLI exits with its code)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ncpctl.errors import UserError
from ncpctl.output import print_wide

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class SweepRequest:
    """``ncpctl sweep``'s arguments as typed (``ncpctl/cli/sweep.py`` documents each flag)."""

    sweep_file: str
    dry: bool = False
    executor: str = "local"
    parallel: int = 1
    out: str | None = None
    verify: bool = False
    rerun_stale: bool = False
    break_lock: bool = False


@dataclass
class SweepFailure:
    """A sweep that ended with points unfinished: the manifest's data, the exit code (1, or 128 + the
    signal that stopped it), the error line and its hint."""

    data: dict[str, Any]
    code: int
    line: str
    hint: str | None


def run_sweep(req: SweepRequest, o: Output) -> SweepFailure | None:
    """Run (or with ``req.dry`` list) the sweep; the result through ``o``, or what did not finish."""
    from ncpctl.study.sweep import EXECUTORS, read_sweep, resolve, write_plan
    from ncpctl.study.sweep_run import make_executor

    executor, parallel, dry = req.executor, req.parallel, req.dry
    if executor not in EXECUTORS:
        raise UserError(f"--executor {executor}: unknown executor; choose from {', '.join(EXECUTORS)}")
    sweep, _ = read_sweep(req.sweep_file, out=req.out)
    sweep.verify, sweep.rerun_stale, sweep.break_lock = req.verify, req.rerun_stale, req.break_lock
    resolve(sweep, strict=not dry)
    for note in sweep.notes:
        o.warn(note)
    if dry:
        o.result({"command": "sweep", "dry": True, **sweep.manifest(), "totals": _totals(sweep), "notes": sweep.notes},
                 lambda con: print_wide(con, _table(sweep, dry=True)))
        return None
    make_executor(executor, sweep, parallel)  # a missing Slurm or a bad slurm: parameter, before anything is written
    write_plan(sweep)
    o.info(f"[dim]{len(sweep.points)} points in {sweep.out} ({executor} executor, {parallel} at a time)[/]")
    _run_shown(o, sweep, executor, parallel)
    unfinished = [p for p in sweep.points if p.status != "done"]
    data = {"command": "sweep", **sweep.manifest(), "totals": _totals(sweep)}
    if sweep.signum:
        import signal

        stopped = [p.name for p in sweep.points if p.status == "interrupted"]
        return SweepFailure(data, 128 + sweep.signum, f"interrupted by {signal.Signals(sweep.signum).name}: "
              f"{len(stopped)} running point(s) stopped ({', '.join(stopped) or 'none'}); rerun the sweep to "
              "resume them from their checkpoints", None)
    if unfinished:
        return SweepFailure(data, 1, f"{len(unfinished)} of {len(sweep.points)} points did not finish: "
              + "; ".join(f"{p.name} ({p.status}{': ' + p.note if p.note else ''})" for p in unfinished),
              "fix what the notes say and rerun the sweep: finished points are skipped, killed ones resume")
    o.result(data, lambda con: con.print(f"{len(sweep.points)} points done: {sweep.out}/manifest.json"))
    return None


def _run_shown(o: Output, sweep: Any, executor: str, parallel: int) -> None:
    """A live table on a terminal; otherwise (a log file: nohup, Slurm, | tee) one plain line per point
    as it ends, and the table once at the end."""
    from rich.live import Live

    from ncpctl.study.sweep_run import run

    if o.err.is_terminal:
        with Live(_table(sweep), console=o.err, refresh_per_second=2, transient=False) as live:
            run(sweep, executor, parallel, show=lambda s: live.update(_table(s)))
        return
    ran: set[str] = set()  # the points this run started and has not reported yet

    def lines(s: Any) -> None:
        ended = ("done", "failed", "interrupted", "stale")
        for p in s.points:
            if p.status == "running":
                ran.add(p.name)
            elif p.name in ran and p.status in ended:
                ran.discard(p.name)
                loss = "" if p.val_loss is None else f", val loss {p.val_loss:.4f}"
                n = sum(q.status in ended for q in s.points)
                o.err.print(f"point {p.name}: {p.status} at step {p.step}/{p.max_steps}{loss}"
                            f"{' (' + p.note + ')' if p.note else ''} [{n}/{len(s.points)} ended]", markup=False)

    run(sweep, executor, parallel, show=lines)
    print_wide(o.err, _table(sweep))


def _totals(sweep: Any) -> dict[str, Any]:
    return {"points": len(sweep.points), "flops": sum(p.flops_per_step * p.max_steps for p in sweep.points),
            "tokens": sum(p.tokens_per_step * p.max_steps for p in sweep.points)}


def _table(sweep: Any, dry: bool = False) -> Any:
    from rich.table import Table

    from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT

    t = Table(title=f"sweep {sweep.name}: {len(sweep.points)} points (base {sweep.base})"
              + (f"; training FLOPs: {FLOP_CONVENTION_SHORT}" if dry else ""), title_justify="left")
    t.add_column("point", overflow="fold")
    varying = [k for k in sweep.keys if len({json.dumps(p.params.get(k), default=str) for p in sweep.points}) > 1]
    shown = varying if len(varying) <= 3 else []  # more: the point's name says them
    for k in shown:
        t.add_column(k.rsplit(".", 1)[-1], justify="right")
    if dry:
        for col in ("steps", "FLOPs/step", "FLOPs", "tokens"):
            t.add_column(col, justify="right", no_wrap=True)
    else:
        for col in ("status", "step", "val loss", "note"):
            t.add_column(col, justify="left" if col in ("status", "note") else "right")
    for p in sweep.points:
        vals = [str(p.params.get(k, "")) for k in shown]
        if dry:
            t.add_row(p.name, *vals, f"{p.max_steps:,}", f"{p.flops_per_step:.4g}", f"{p.flops_per_step * p.max_steps:.4g}",
                      f"{p.tokens_per_step * p.max_steps:.4g}")
        else:
            style = {"done": "green", "failed": "red", "locked": "yellow", "running": "cyan", "stale": "magenta",
                     "interrupted": "yellow"}.get(p.status, "")
            t.add_row(p.name, *vals, f"[{style}]{p.status}[/]" if style else p.status, f"{p.step}/{p.max_steps}",
                      "" if p.val_loss is None else f"{p.val_loss:.4f}", p.note)
    if dry:
        tot = _totals(sweep)
        t.add_row("total", *[""] * len(shown), "", "", f"{tot['flops']:.4g}", f"{tot['tokens']:.4g}")
    return t
