"""`ncpctl fit`: scaling laws and compute multipliers from a table of runs or run directories
(ncpctl.study)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, command
from ncpctl.errors import UserError


@command
def main(
    inputs: Annotated[list[str], typer.Argument(
        help="A JSON or CSV table of points (columns family, N, D, C, loss, ...; optional name, budget, "
        "tokenizer, val_set; lr and width for --transfer), `ncpctl pretrain` run directories, or directories "
        "holding runs (a sweep's, searched at any depth), or a fit's own fit.json.",
        show_default=False, metavar="TABLE|RUN_DIR")],
    metric: Annotated[str, typer.Option("--metric", "-m", help="The metric to fit (a table column, or a key of "
                                        "the runs' validation records); `1-NAME` fits the complement of a metric "
                                        "that rises with scale (e.g. 1-concept_auc).")] = "loss",
    baseline: Annotated[Optional[str], typer.Option(
        "--baseline", help="The compute multiplier's baseline family (default: the first of two families).",
        show_default=False)] = None,
    family: Annotated[Optional[str], typer.Option(
        "--family", help="The family whose multiplier against --baseline is reported (default: the other one).",
        show_default=False)] = None,
    at_loss: Annotated[Optional[float], typer.Option(
        "--at-loss", help="Read the multiplier at this loss (default: --family's frontier at --at-budget).",
        show_default=False)] = None,
    at_budget: Annotated[Optional[float], typer.Option(
        "--at-budget", help="Read the multiplier at --family's frontier loss at this many FLOPs (default: the "
        "geometric middle of its runs' FLOPs).", show_default=False)] = None,
    holdout: Annotated[Optional[list[str]], typer.Option(
        "--holdout", metavar="NAME", help="Points the extrapolation check holds out (repeatable; default: the "
        "largest budget of each family).", show_default=False)] = None,
    resamples: Annotated[int, typer.Option("--resamples", min=0, help="Bootstrap resamples (0: no intervals).")] = 200,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the bootstrap.")] = 0,
    family_from_parent: Annotated[bool, typer.Option(
        "--family-from-parent", help="A run directory's family is its parent directory's name (runs/base/s1, "
        "runs/conceptlm/s1), a sweep's point's (OUT/runs/NAME) the sweep's, OUT's; default: one family.")] = False,
    out: Annotated[Optional[str], typer.Option(
        "--out", help="Directory of fit.json, fit.md and the plots (default: ./fit).", show_default=False)] = None,
    dlcm: Annotated[bool, typer.Option(
        "--dlcm", help="Also fit DLCM's Eq. 22, L(N, D, R, P) with the concept share P and the compression R "
        "(columns R and P; run directories carry them), at the non-embedding N where every point has it. Points "
        "with a stable_loss column (the loss before a WSD decay; a decay branch's run directory carries it) also "
        "get the decay-phase law Δ = k L_stable^a R^b N^c.")] = False,
    transfer: Annotated[bool, typer.Option(
        "--transfer", help="Instead of the scaling laws, the muP learning-rate transfer view (DLCM Fig. 3): "
        "per width, the metric against log2 lr and its optimum, and whether the optimum stays put across widths "
        "(points of several widths x several base rates, e.g. recipes/sweeps/dlcm-mup-transfer.yaml's runs).")] = False,
    lr_column: Annotated[str, typer.Option(
        "--lr-column", help="--transfer: the rate on the x axis: lr (train.lr), lr_token or lr_concept (decoupled "
        "muP's module base rates).")] = "lr",
    tolerance: Annotated[float, typer.Option(
        "--tolerance", help="--transfer: the optimum stays put when its spread over the widths is within this "
        "many grid steps (the median spacing of the rates in log2).")] = 1.0,
    exclude_embeddings: Annotated[bool, typer.Option(
        "--exclude-embeddings", help="N and C without the embeddings and the LM head (columns N_nonembedding and "
        "C_nonembedding; run directories carry them): the Kaplan et al. convention NCP-ArchPreview's C follows. "
        "An LM head both families share pulls a multiplier toward 1.")] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Do not draw the plots.")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Fit scaling laws to trained runs: IsoFLOP parabolas (N_opt and D_opt per budget, N_opt ∝ C^a,
    bootstrap intervals), the joint law L(N, D) = E + A/N^α + B/D^β per family (Huber loss in log
    space, L-BFGS from a grid, bootstrap 90% intervals refitted from the grid), the compute multiplier
    between two families at equal loss (each shape at its exact cost; the joint law's and the IsoFLOP
    envelopes'), and an extrapolation check (the largest budget held out, the law's prediction beside
    the naive log-linear one). What was skipped, and why, is said; a law of few points is cautioned.

    Writes fit.json, fit.md and (with matplotlib) fit_frontier.png, fit_residuals.png and
    fit_isoflop.png to --out (--transfer: the transfer view and fit_transfer.png). Runs of different
    tokenizers or validation sets are refused.
    """
    from ncpctl.study.fit import FitOptions, analyse
    from ncpctl.study.points import read_points, where_found
    from ncpctl.study.report import write

    out_ = Output(json_out)
    if at_loss is not None and at_budget is not None:
        raise UserError("--at-loss and --at-budget are alternatives: give one")
    for name, v in (("--at-loss", at_loss), ("--at-budget", at_budget)):
        if v is not None and not v > 0:
            raise UserError(f"{name} must be positive, got {v:g}")
    if transfer and dlcm:
        raise UserError("--transfer and --dlcm are alternatives: the transfer view fits no scaling law")
    found: dict = {}
    points = read_points(inputs, family_from_parent, found)
    for root, runs in found.items():  # where the run directories were found (any depth)
        out_.info(f"[dim]{where_found(root, runs)}[/]")
    if transfer:
        from ncpctl.study.transfer import analyse_transfer

        report = analyse_transfer(points, metric, lr_column, tolerance)
        write(report, points, Path(out) if out else Path("fit"), draw=not no_plots)
        out_.result({"command": "fit", **report}, lambda con: _human_transfer(con, report))
        return
    opts = FitOptions(metric=metric, resamples=resamples, seed=seed, baseline=baseline, family=family,
                      at_loss=at_loss, at_budget=at_budget, holdout=tuple(holdout or ()), dlcm=dlcm,
                      exclude_embeddings=exclude_embeddings)
    out_.info(f"[dim]fitting {metric} of {len(points)} points ({resamples} bootstrap resamples)[/]")
    report = analyse(points, opts)
    for line in report["warnings"]:
        out_.warn(line)
    write(report, points, Path(out) if out else Path("fit"), draw=not no_plots)
    out_.result({"command": "fit", **report}, lambda con: _human(con, report))


def _human(con, report: dict) -> None:
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


def _human_transfer(con, report: dict) -> None:
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
