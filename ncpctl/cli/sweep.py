"""`ncpctl sweep SWEEP.yaml`: a scaling study's points as child recipes, run through submitit
(ncpctl.study.sweep, where the sweep file format is documented)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, command


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
    from ncpctl.study.sweep_command import SweepRequest, run_sweep

    failed = run_sweep(SweepRequest(sweep_file, dry=dry, executor=executor, parallel=parallel, out=out, verify=verify,
                                    rerun_stale=rerun_stale, break_lock=break_lock), Output(json_out))
    if failed is not None:
        _exit(json_out, failed.data, failed.code, failed.line, failed.hint)


def _exit(json_out: bool, data: dict[str, Any], code: int, line: str, hint: str | None) -> None:
    from ncpctl.cli._common import report_failure

    report_failure(False, [line], hint, code)
    if json_out:
        sys.stdout.write(json.dumps({"ok": False, "exit_code": code, "errors": [line], **data}, default=str) + "\n")
    raise typer.Exit(code)
