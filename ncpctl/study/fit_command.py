"""What ``ncpctl fit`` calls: ``run_fit(FitRequest, out)`` reads the points (tables, run directories),
fits the scaling laws (``fit.analyse``) or the muP transfer view (``transfer.analyse_transfer``),
writes fit.json, fit.md and the plots (``report.write``) and reports through ``out``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class FitRequest:
    """``ncpctl fit``'s arguments as typed (``ncpctl/cli/fit.py`` documents each flag)."""

    inputs: list[str]
    metric: str = "loss"
    baseline: str | None = None
    family: str | None = None
    at_loss: float | None = None
    at_budget: float | None = None
    holdout: list[str] | None = None
    resamples: int = 200
    seed: int = 0
    family_from_parent: bool = False
    out: str | None = None
    dlcm: bool = False
    transfer: bool = False
    lr_column: str = "lr"
    tolerance: float = 1.0
    exclude_embeddings: bool = False
    no_plots: bool = False


def run_fit(req: FitRequest, out: Output) -> None:
    """Fit the request's points; fit.json, fit.md and the plots to ``req.out`` (default ./fit)."""
    from ncpctl.study.fit import FitOptions, analyse
    from ncpctl.study.points import read_points, where_found
    from ncpctl.study.report import write

    r = req
    metric, at_loss, at_budget, resamples = r.metric, r.at_loss, r.at_budget, r.resamples
    out_dir = Path(r.out) if r.out else Path("fit")
    if at_loss is not None and at_budget is not None:
        raise UserError("--at-loss and --at-budget are alternatives: give one")
    for name, v in (("--at-loss", at_loss), ("--at-budget", at_budget)):
        if v is not None and not v > 0:
            raise UserError(f"{name} must be positive, got {v:g}")
    if r.transfer and r.dlcm:
        raise UserError("--transfer and --dlcm are alternatives: the transfer view fits no scaling law")
    found: dict = {}
    points = read_points(r.inputs, r.family_from_parent, found)
    for root, runs in found.items():  # where the run directories were found (any depth)
        out.info(f"[dim]{where_found(root, runs)}[/]")
    if r.transfer:
        from ncpctl.study.transfer import analyse_transfer

        report = analyse_transfer(points, metric, r.lr_column, r.tolerance)
        write(report, points, out_dir, draw=not r.no_plots)
        out.result({"command": "fit", **report}, lambda con: human_transfer(con, report))
        return
    opts = FitOptions(metric=metric, resamples=resamples, seed=r.seed, baseline=r.baseline, family=r.family,
                      at_loss=at_loss, at_budget=at_budget, holdout=tuple(r.holdout or ()), dlcm=r.dlcm,
                      exclude_embeddings=r.exclude_embeddings)
    out.info(f"[dim]fitting {metric} of {len(points)} points ({resamples} bootstrap resamples)[/]")
    report = analyse(points, opts)
    for line in report["warnings"]:
        out.warn(line)
    write(report, points, out_dir, draw=not r.no_plots)
    out.result({"command": "fit", **report}, lambda con: human(con, report))


def human(con, report: dict) -> None:
    """The laws, the IsoFLOP parabolas, the multiplier and the checks, for people."""
    from rich.table import Table

    from ncpctl.study.report import (ISOFLOP_COLUMNS, LAW_COLUMNS, LAW_NOTE, dlcm_lines, extrapolation_line, header,
                                     isoflop_rows, law_rows, multiplier_line, notes)

    con.print(f"[dim]{header(report)}[/]", soft_wrap=True)
    t = Table(title=f"{report['metric']}: L(N, D) = E + A/N^α + B/D^β (90% bootstrap intervals)", title_justify="left",
              caption=LAW_NOTE, caption_justify="left")
    for col in LAW_COLUMNS:  # folded, never cut: an interval's end is a number to read whole
        t.add_column(col, justify="left" if col == "family" else "right", overflow="fold")
    for row in law_rows(report):
        t.add_row(*row)
    con.print(t)
    t = Table(title="IsoFLOP parabolas (* vertex outside the sampled sizes)", title_justify="left")
    for col in ISOFLOP_COLUMNS:
        t.add_column(col, justify="left" if col == "family" else "right", overflow="fold")
    for name, fam in report["families"].items():
        for row in isoflop_rows(name, fam["isoflop"]):
            t.add_row(*row)
    if t.row_count:
        con.print(t)
    for line in notes(report)[len(report["warnings"]):]:  # the warnings went to stderr already
        con.print(line, soft_wrap=True)
    for name, fam in report["families"].items():
        con.print(extrapolation_line(name, fam["extrapolation"]), soft_wrap=True)
        for line in dlcm_lines(name, fam):
            con.print(line)
    for key, approach in (("multiplier", "joint law"), ("multiplier_isoflop", "IsoFLOP envelopes")):
        if key in report:
            con.print(multiplier_line(report[key], approach), soft_wrap=True)
    if report.get("plots_note"):
        con.print(f"[dim]{report['plots_note']}[/]")
    con.print("[dim]" + "\n".join(report["files"].values()) + "[/]")


def human_transfer(con, report: dict) -> None:
    """The muP transfer view, for people."""
    from rich.table import Table

    from ncpctl.study.transfer import TRANSFER_COLUMNS, transfer_rows, transfer_verdict

    t = report["transfer"]
    tab = Table(title=f"muP transfer: {report['metric']} against {t['lr_column']} per width", title_justify="left")
    for col in TRANSFER_COLUMNS:
        tab.add_column(report["metric"] if col == "METRIC" else col, justify="left" if col in ("width", "method") else "right")
    for row in transfer_rows(t):
        tab.add_row(*row)
    con.print(tab)
    con.print(transfer_verdict(t), soft_wrap=True)
    if report.get("plots_note"):
        con.print(f"[dim]{report['plots_note']}[/]")
    con.print("[dim]" + "\n".join(report["files"].values()) + "[/]")
