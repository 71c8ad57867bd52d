"""`ncpctl sweep SWEEP.yaml`: a scaling study's points as child recipes, run through submitit
(ncpctl.study.sweep, where the sweep file format is documented)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, command, print_wide
from ncpctl.errors import UserError


@command
def main(
    sweep_file: Annotated[str, typer.Argument(help="Sweep YAML file (see recipes/sweeps/).", show_default=False,
                                              metavar="SWEEP")],
    dry: Annotated[bool, typer.Option("--dry", help="List the points with their exact training FLOPs and tokens; "
                                      "write and train nothing.")] = False,
    executor: Annotated[str, typer.Option("--executor", help="local (this machine) or slurm (job arrays); both "
                                          "through submitit.")] = "local",
    parallel: Annotated[int, typer.Option("--parallel", min=1, help="Points run at a time (local: processes here; "
                                          "slurm: the array's parallelism).")] = 1,
    out: Annotated[Optional[str], typer.Option("--out", help="Directory of the points, runs and manifest.json "
                                               "(default: the sweep's out, or runs/sweeps/NAME).",
                                               show_default=False)] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check each finished point's final checkpoint against "
                                         "its manifest's checksums (reads every byte), not its sizes alone.")] = False,
    rerun_stale: Annotated[bool, typer.Option("--rerun-stale", help="Train stale points again (their old run "
                                              "directories are moved to OUT/stale/, never deleted).")] = False,
    break_lock: Annotated[bool, typer.Option("--break-lock", help="Start points whose run directory is locked by "
                                             "another host (pretrain --break-lock); a live run of this host "
                                             "is never broken.")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run a sweep: one child recipe per point (OUT/points/NAME.yaml, which `extends:` the base
    recipe and sets the point's keys and run.dir OUT/runs/NAME), a manifest (OUT/manifest.json),
    and each point's `ncpctl pretrain` through submitit, with a progress table.

    A sweep file names a `base` recipe and `axes` (a grid), `zip` (lists varied together, or a list
    of such groups, each one more axis) and/or `points` (explicit), each a recipe key path with its
    values, and `fixed` keys set for every point. Rerunning skips finished points, resumes killed
    ones from their checkpoints and never starts a point whose run directory is locked by a live
    process; a finished point whose checkpoint or recipe no longer matches is shown stale.
    Ctrl-C, SIGTERM and SIGHUP stop the points with their checkpoints saved (a second one kills them).
    """
    from ncpctl.study.sweep import EXECUTORS, read_sweep, resolve, write_plan
    from ncpctl.study.sweep_run import make_executor

    o = Output(json_out)
    if executor not in EXECUTORS:
        raise UserError(f"--executor {executor}: unknown executor; choose from {', '.join(EXECUTORS)}")
    sweep, _ = read_sweep(sweep_file, out=out)
    sweep.verify, sweep.rerun_stale, sweep.break_lock = verify, rerun_stale, break_lock
    resolve(sweep, strict=not dry)
    for note in sweep.notes:
        o.warn(note)
    if dry:
        o.result({"command": "sweep", "dry": True, **sweep.manifest(), "totals": _totals(sweep), "notes": sweep.notes},
                 lambda con: print_wide(con, _table(sweep, dry=True)))
        return
    make_executor(executor, sweep, parallel)  # a missing Slurm or a bad slurm: parameter, before anything is written
    write_plan(sweep)
    o.info(f"[dim]{len(sweep.points)} points in {sweep.out} ({executor} executor, {parallel} at a time)[/]")
    _run_shown(o, sweep, executor, parallel)
    unfinished = [p for p in sweep.points if p.status != "done"]
    data = {"command": "sweep", **sweep.manifest(), "totals": _totals(sweep)}
    if sweep.signum:
        import signal

        stopped = [p.name for p in sweep.points if p.status == "interrupted"]
        _exit(json_out, data, 128 + sweep.signum, f"interrupted by {signal.Signals(sweep.signum).name}: "
              f"{len(stopped)} running point(s) stopped ({', '.join(stopped) or 'none'}); rerun the sweep to "
              "resume them from their checkpoints", None)
    if unfinished:
        _exit(json_out, data, 1, f"{len(unfinished)} of {len(sweep.points)} points did not finish: "
              + "; ".join(f"{p.name} ({p.status}{': ' + p.note if p.note else ''})" for p in unfinished),
              "fix what the notes say and rerun the sweep: finished points are skipped, killed ones resume")
    o.result(data, lambda con: con.print(f"{len(sweep.points)} points done: {sweep.out}/manifest.json"))


def _exit(json_out: bool, data: dict[str, Any], code: int, line: str, hint: str | None) -> None:
    from ncpctl.cli._common import report_failure

    report_failure(False, [line], hint, code)
    if json_out:
        sys.stdout.write(json.dumps({"ok": False, "exit_code": code, "errors": [line], **data}, default=str) + "\n")
    raise typer.Exit(code)


def _run_shown(o: Output, sweep: Any, executor: str, parallel: int) -> None:
    """A live table on a terminal; otherwise (a log file: nohup, Slurm, | tee) one plain line per point
    as it ends, and the table once at the end."""
    from rich.live import Live

    from ncpctl.cli._common import print_wide
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
