"""The files of ``ncpctl fit``: ``fit.json`` (the report), ``fit.md`` (its tables) and, when
matplotlib is installed, ``fit_frontier.png`` (the metric against compute, every family's
points and fitted frontier), ``fit_residuals.png`` (measured minus the joint law, against C) and
``fit_isoflop.png`` (the IsoFLOP curves with their parabolas); with ``--transfer`` (a report with a
``transfer`` section) the transfer view's table and ``fit_transfer.png`` instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ncpctl.fsutil import atomic_write
from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT
from ncpctl.study.cost import Cost
from ncpctl.study.law import Law
from ncpctl.study.points import Point, values


def _g(v: Any, digits: int = 4) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not np.isfinite(v):
        return "inf" if v > 0 else "nan"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _ci(ci: list[float] | None) -> str:
    return f"[{_g(ci[0])}, {_g(ci[1])}]" if ci else ""


def law_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per family: the law's parameters with their 90% intervals and the allocation exponent a."""
    rows = []
    for name, fam in report["families"].items():
        law, ci, ex = fam["law"], fam.get("ci90", {}), fam["exponents"]
        rows.append([name, str(fam["points"]) + (" (!)" if fam.get("cautions") else ""),
                     *(f"{_g(law[k])} {_ci(ci.get(k))}".strip() for k in ("E", "A", "B", "alpha", "beta")),
                     f"{_g(ex['N_opt'], 3)} {_ci(ex.get('ci90'))}".strip()])
    return rows


LAW_COLUMNS = ["family", "points", "E", "A", "B", "α", "β", "N_opt ∝ C^a"]
LAW_NOTE = ("a = β/(α+β); D_opt ∝ C^(1−a) where C ∝ N·D (b = 1 − a); (!): see the cautions")


def header(report: dict[str, Any]) -> str:
    """What N and C count: the FLOP convention and whether the embeddings are in."""
    return (f"C: training FLOPs, {report.get('flop_convention', 'full attention')}; N and C: "
            f"{report.get('N_C', 'all parameters and FLOPs')}; each shape at its exact cost per token")


def _unreachable(m: dict[str, Any]) -> str:
    u = m.get("unreachable") or {}
    parts = [f"{u[k]} where {who}" for k, who in (("family", f"{m['family']} never reaches it (counted as 0)"),
                                                   ("baseline", f"{m['baseline']} never does (inf)"),
                                                   ("both", "neither does (left out)")) if u.get(k)]
    return f" (of {m['resamples']} resamples: {'; '.join(parts)})" if parts else ""


def multiplier_line(m: dict[str, Any], approach: str = "joint law") -> str:
    if "skipped" in m:
        return f"compute multiplier ({approach}) skipped: {m['skipped']}"
    at = f"loss {_g(m['loss'])}" + (f" (the {m['family']} {'frontier' if approach == 'joint law' else 'envelope'} "
                                    f"at C = {_g(m['budget'], 3)})" if m["budget"] else "")
    line = (f"compute multiplier of {m['family']} against {m['baseline']} ({approach}): {_g(m['value'])} "
            f"{('90% CI ' + _ci(m['ci90'])) if m.get('ci90') else ''} at {at}; "
            f"{m['baseline']} needs {_g(m['C_baseline'], 3)} FLOPs, {m['family']} {_g(m['C_family'], 3)}"
            + _unreachable(m))
    return line + (f"; caution: {m['caution']}" if m.get("caution") else "")


def isoflop_rows(name: str, iso: dict[str, Any]) -> list[list[str]]:
    """The IsoFLOP table's rows of one family: each budget's vertex (its interval; * outside the sizes),
    the residual RMSE where the parabola has degrees of freedom, the power law, the skipped budgets."""
    rows = []
    for r in iso["budgets"]:
        rows.append([name, _g(r["budget"], 3), str(r["points"]), f"{_g(r['N_opt'], 3)}{'' if r['inside'] else '*'} "
                     f"{_ci(r.get('N_opt_ci90'))}".strip(), _g(r["D_opt"], 3), _g(r["min"]),
                     "-" if r["rmse"] is None else _g(r["rmse"], 2)])
    if "N_opt_exponent" in iso:
        rows.append([name, "power law", "", f"a = {iso['N_opt_exponent']:.3f} "
                     f"{_ci((iso.get('ci90') or {}).get('N_opt_exponent'))}".strip(), "b = 1 − a", "", ""])
    return rows


ISOFLOP_COLUMNS = ["family", "budget C", "points", "N_opt", "D_opt", "min", "rmse"]


def iso_notes(name: str, iso: dict[str, Any]) -> list[str]:
    """What the IsoFLOP view skipped or set aside, and why."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in iso["skipped"]:
        by.setdefault(r["why"], []).append(r)
    out = [f"{name}: budget {_g(rs[0]['budget'], 3)} ({rs[0]['points']} points) skipped: {why}" if len(rs) == 1 else
           f"{name}: {len(rs)} budgets ({_g(rs[0]['budget'], 3)} to {_g(rs[-1]['budget'], 3)}) skipped: {why}"
           for why, rs in by.items()]
    if iso.get("outside"):
        out.append(f"{name}: * the vertex at budget(s) {', '.join(_g(c, 3) for c in iso['outside'])} lies outside the "
                   "sampled sizes (an extrapolation): kept out of the exponent and the envelope")
    if any(r["rmse"] is None for r in iso["budgets"]):
        out.append(f"{name}: rmse '-': a parabola through 3 points has no residual degrees of freedom")
    if iso["budgets"] and "N_opt_exponent" not in iso:
        out.append(f"{name}: no IsoFLOP exponent (fewer than two budgets with a vertex inside the sizes)")
    return out


def extrapolation_line(name: str, ex: dict[str, Any]) -> str:
    if "skipped" in ex:
        return f"{name}: extrapolation check skipped ({ex['skipped']})"
    b = ex["best"]
    line = (f"{name}: held out {len(ex['held_out'])} point(s), fitted on {ex['fitted_on']}; best held-out "
            f"{b['name']}: measured {_g(b['measured'])}, law {_g(b['predicted'])} (error {b['error']:+.3f})")
    if "log_linear" in ex:
        line += f", log-linear {_g(ex['log_linear']['predicted'])} (error {ex['log_linear']['error']:+.3f})"
    return line


def dlcm_lines(name: str, fam: dict[str, Any]) -> list[str]:
    """DLCM's Eq. 22 and the decay-phase law of a family, when fitted."""
    out = []
    if "dlcm" in fam:
        law = fam["dlcm"]["law"]
        out.append(f"{name}: Eq. 22 " + ", ".join(f"{k} {_g(v)}" for k, v in law.items())
                   + f" (rmse {_g(fam['dlcm']['rmse'], 3)})")
    if "decay" in fam:
        d = fam["decay"]
        out.append(f"{name}: decay phase Δ = {_g(d['k'])} L_stable^{d['a']:.3f} R^{d['b']:.3f} N^{d['c']:.3f} "
                   f"(R² {d['r2']:.3f})")
    return out


def notes(report: dict[str, Any]) -> list[str]:
    """Every caution, warning and skip of a report, one line each (the terminal's and fit.md's)."""
    out = list(report.get("warnings", []))
    for name, fam in report["families"].items():
        out += [f"{name}: caution: {c}" for c in fam.get("cautions", [])]
        out += iso_notes(name, fam["isoflop"])
    return out


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Scaling fit of {report['metric']} ({report['points']} points)", "", header(report), "",
           "## Joint law L(N, D) = E + A/N^α + B/D^β (Huber in log space; 90% bootstrap intervals)", "",
           "| " + " | ".join(LAW_COLUMNS) + " |", "|" + "---|" * len(LAW_COLUMNS)]
    out += ["| " + " | ".join(r) + " |" for r in law_rows(report)] + ["", LAW_NOTE]
    if "multiplier" in report:
        m = report["multiplier"]
        out += ["", "## Compute multiplier", "", multiplier_line(m)]
        if m.get("by_budget"):
            out += ["", "| budget C | multiplier |", "|---|---|",
                    *(f"| {_g(r['budget'], 3)} | {_g(r['value'])} |" for r in m["by_budget"])]
        if "multiplier_isoflop" in report:
            out += ["", multiplier_line(report["multiplier_isoflop"], "IsoFLOP envelopes")]
    out += ["", "## IsoFLOP parabolas", "", "| " + " | ".join(ISOFLOP_COLUMNS) + " |", "|" + "---|" * len(ISOFLOP_COLUMNS)]
    for name, fam in report["families"].items():
        out += ["| " + " | ".join(r) + " |" for r in isoflop_rows(name, fam["isoflop"])]
    lines = notes(report)
    if lines:
        out += ["", "## Cautions, warnings and what was skipped", "", *(f"- {line}" for line in lines)]
    out += ["", "## Extrapolation check", ""]
    out += [f"- {extrapolation_line(n, f['extrapolation'])}" for n, f in report["families"].items()]
    dl = [line for n, f in report["families"].items() for line in dlcm_lines(n, f)]
    if dl:
        out += ["", "## DLCM (Eq. 22, decay phase)", "", *(f"- {line}" for line in dl)]
    if report.get("plots_note"):
        out += ["", report["plots_note"]]
    out += [f"", *(f"![{p}]({p})" for p in report.get("plots", []))]
    return "\n".join(out) + "\n"


def plots(report: dict[str, Any], points: list[Point], out_dir: Path) -> tuple[list[str], str | None]:
    """The PNGs (names), or none and a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    metric = report["metric"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, fam) in enumerate(report["families"].items()):
        pts = [p for p in points if p.family == name]
        colour = f"C{i}"
        ax.scatter([p.C for p in pts], values(pts, metric), s=14, color=colour, alpha=0.6, label=name)
        law, cost = Law(**fam["law"]), Cost.from_dict(fam["cost"])
        cs = np.geomspace(min(p.C for p in pts) / 2, max(p.C for p in pts) * 4, 100)
        ax.plot(cs, [cost.frontier(law, c) for c in cs], color=colour, lw=1.5,
                label=f"{name} frontier (α={law.alpha:.2f}, β={law.beta:.2f})")
    ax.set(xscale="log", xlabel=f"training FLOPs C ({FLOP_CONVENTION_SHORT})", ylabel=metric,
           title=f"{metric} against compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "fit_frontier.png", dpi=120)
    plt.close(fig)
    names = ["fit_frontier.png"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (name, fam) in enumerate(report["families"].items()):
        pts = [p for p in points if p.family == name]
        pred = Law(**fam["law"]).loss(np.array([p.N for p in pts]), np.array([p.D for p in pts]))
        ax.scatter([p.C for p in pts], values(pts, metric) - pred, s=14, color=f"C{i}",
                   label=name)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel=f"training FLOPs C ({FLOP_CONVENTION_SHORT})", ylabel=f"{metric} − law",
           title="residuals of the joint law")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "fit_residuals.png", dpi=120)
    plt.close(fig)
    names.append("fit_residuals.png")
    fig = isoflop_figure(report)
    if fig is not None:
        fig.savefig(out_dir / "fit_isoflop.png", dpi=120)
        plt.close(fig)
        names.append("fit_isoflop.png")
    return names, None


def isoflop_figure(report: dict[str, Any]) -> Any:
    """fit_isoflop.png's figure: per family the IsoFLOP curves, their parabolas and vertices (★); None
    when no family has a parabola."""
    import matplotlib.pyplot as plt

    fams = [(n, f) for n, f in report["families"].items() if f["isoflop"]["budgets"]]
    if not fams:
        return None
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 4), squeeze=False)
    for ax, (name, fam) in zip(axes[0], fams):
        for j, r in enumerate(fam["isoflop"]["budgets"]):
            x = np.log(r["sizes"])
            xs = np.linspace(x.min(), x.max(), 50)
            ax.scatter(r["sizes"], r["values"], s=12, color=f"C{j}")
            ax.plot(np.exp(xs), np.polyval(r["coef"], xs), color=f"C{j}", lw=1, label=f"C={r['budget']:.2g}")
            ax.scatter([r["N_opt"]], [r["min"]], marker="*", s=60, color=f"C{j}")
        ax.set(xscale="log", xlabel="parameters N", ylabel=report["metric"], title=f"{name}: IsoFLOP curves (★ vertex)")
        size_ticks(ax, sorted({n for r in fam["isoflop"]["budgets"] for n in r["sizes"]}))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def size_ticks(ax: Any, sizes: list[float]) -> None:
    """Ticks at the sampled sizes, written compactly (72k, 1.1M) and slanted, no minor labels: a log
    axis's default labels (2×10^5, 3×10^5, ...) run into each other over a narrow range of N."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    def short(n: float) -> str:
        for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if n >= div:
                return f"{n / div:.3g}{unit}"
        return f"{n:.3g}"

    gap = (np.log(max(sizes)) - np.log(min(sizes))) / 8 if len(sizes) > 1 else 0.0
    kept: list[float] = []
    for n in sizes:  # thinned: a tick at least 1/8 of the axis from the last one kept
        if not kept or np.log(n) - np.log(kept[-1]) >= gap:
            kept.append(n)
    sizes = kept
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sizes, [short(n) for n in sizes], rotation=45, ha="right", fontsize=8)


def transfer_markdown(report: dict[str, Any]) -> str:
    """fit.md of ``--transfer``: the optimum per width and the verdict."""
    from ncpctl.study.transfer import TRANSFER_COLUMNS, transfer_rows, transfer_verdict

    t = report["transfer"]
    cols = [c if c != "METRIC" else f"{report['metric']} at the optimum" for c in TRANSFER_COLUMNS]
    cols[cols.index("shift")] = "shift (grid steps)"
    out = [f"# muP learning-rate transfer of {report['metric']} ({report['points']} points)", "",
           f"Per width, {report['metric']} against log2 {t['lr_column']}: the vertex of the parabola through the "
           "best rate and its neighbours (`parabola`), or the best rate (`argmin`: fewer than 3 rates; "
           "`argmin-edge`: the best is the grid's edge, a bound). Shifts are from the reference width "
           f"{_g(t['reference_width'])} (the smallest).", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r) + " |" for r in transfer_rows(t)]
    out += ["", transfer_verdict(t)]
    if report.get("plots_note"):
        out += ["", report["plots_note"]]
    out += ["", *(f"![{p}]({p})" for p in report.get("plots", []))]
    return "\n".join(out) + "\n"


VERDICT = {True: "stays put", False: "moves", None: "undetermined (an optimum at the grid's edge)"}


def transfer_plot(report: dict[str, Any], out_dir: Path) -> tuple[list[str], str | None]:
    """fit_transfer.png: the metric against lr per width (log x), each width's parabola and optimum (Fig. 3)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    t = report["transfer"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(t["widths"]):
        colour = f"C{i}"
        ax.plot(r["lrs"], r["values"], "o-", color=colour, lw=0.8, ms=4, label=f"width {r['width']:g}")
        if r["coef"]:
            x = np.log2(r["lrs"])
            k = int(np.argmin(r["values"]))
            xs = np.linspace(x[k - 1], x[k + 1], 40)
            ax.plot(2.0 ** xs, np.polyval(r["coef"], xs), color=colour, lw=1.5, ls="--")
        ax.scatter([r["opt_lr"]], [r["opt_value"]], marker="*", s=90, color=colour, zorder=3)
    ax.set(xscale="log", xlabel=t["lr_column"], ylabel=report["metric"],
           title=f"muP transfer: {VERDICT[t['stays_put']]} (spread {t['spread_steps']:.2f} grid steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "fit_transfer.png", dpi=120)
    plt.close(fig)
    return ["fit_transfer.png"], None


def write(report: dict[str, Any], points: list[Point], out_dir: Path, draw: bool = True) -> dict[str, str]:
    """fit.json, fit.md and the plots into out_dir; returns the paths written (``report['files']``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    is_transfer = "transfer" in report
    draw_fn = (lambda: transfer_plot(report, out_dir)) if is_transfer else (lambda: plots(report, points, out_dir))
    names, note = draw_fn() if draw else ([], "plots skipped (--no-plots)")
    report["plots"], report["plots_note"] = names, note
    files = {"json": str(out_dir / "fit.json"), "markdown": str(out_dir / "fit.md"),
             **{n.removesuffix(".png"): str(out_dir / n) for n in names}}
    report["files"] = files
    atomic_write(out_dir / "fit.json", json.dumps({**report, "input": [p.to_dict() for p in points]},
                                                  indent=2, default=float) + "\n")
    atomic_write(out_dir / "fit.md", transfer_markdown(report) if is_transfer else markdown(report))
    return files
