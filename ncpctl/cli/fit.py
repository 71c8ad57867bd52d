"""`ncpctl fit`: scaling laws and compute multipliers from a table of runs or run directories
(the work: ncpctl.study.fit_command)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, command


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
    from ncpctl.study.fit_command import FitRequest, run_fit

    run_fit(FitRequest(
        inputs, metric=metric, baseline=baseline, family=family, at_loss=at_loss, at_budget=at_budget, holdout=holdout,
        resamples=resamples, seed=seed, family_from_parent=family_from_parent, out=out, dlcm=dlcm, transfer=transfer,
        lr_column=lr_column, tolerance=tolerance, exclude_embeddings=exclude_embeddings, no_plots=no_plots),
        Output(json_out))
