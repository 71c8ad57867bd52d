"""Scaling-law analyses of a set of runs (``ncpctl fit``): IsoFLOP parabolas, the joint law per
family with bootstrap intervals, a compute multiplier between two families, an extrapolation check.

* IsoFLOP (Hoffmann et al.'s approach 2): per budget, the metric against x = ln N as a parabola;
  its vertex gives N_opt, and D_opt = C / (f · N_opt) with the family's f = C / (N · D) (the
  exact FLOPs per parameter and token of its runs, their median); then N_opt ∝ C^a and
  D_opt ∝ C^b by least squares in log-log.
* The joint law (approach 3, ``ncpctl.study.law``) per family, with percentile intervals over
  ``resamples`` bootstrap refits (points drawn with replacement within the family).
* The compute multiplier of ``family`` against ``baseline`` at equal loss: C_baseline(L) /
  C_family(L), where C_x(L) is the compute at which x's fitted frontier reaches L; L is the
  ``family``'s frontier at a reference budget (default the geometric middle of its runs' C,
  ``reference_budget``), or a given loss. Above 1:
  the baseline needs that many times the compute of ``family`` for the same loss. Its interval
  pairs the two families' bootstrap laws resample by resample (the reference loss recomputed
  from each).
* The extrapolation check: the points of the largest budget (or named points) held out, the law
  fitted on the rest predicts them; beside it, the naive log-linear law of the best loss per
  budget against C (a straight line in log-log through the other budgets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ncpctl.errors import UserError
from ncpctl.study.law import Law, bootstrap_laws, fit_law
from ncpctl.study.points import Point

BUDGET_TOLERANCE = 0.05  # points whose C differ by under 5% share an IsoFLOP budget (when no budget column)


@dataclass(frozen=True)
class FitOptions:
    metric: str = "loss"
    resamples: int = 200
    seed: int = 0
    starts: int = 8
    baseline: str | None = None  # the multiplier's baseline family
    family: str | None = None  # the multiplier's family (default: the other one)
    at_loss: float | None = None
    at_budget: float | None = None
    holdout: tuple[str, ...] = ()  # point names held out by the extrapolation check (default: largest budget)
    dlcm: bool = False  # also fit DLCM's Eq. 22 (columns R and P)


def values(points: Sequence[Point], metric: str) -> np.ndarray:
    """The metric of every point; ``1-NAME`` is the complement of NAME (a metric that rises with
    scale, an AUC or an alignment, fitted as one that falls, as the law's form needs)."""
    name = metric[2:] if metric.startswith("1-") else metric
    missing = [p.name for p in points if name not in p.metrics]
    if missing:
        known = sorted({k for p in points for k in p.metrics})
        raise UserError(f"unknown metric {name!r}: {len(missing)} point(s) lack it (first: {missing[0]})",
                        hint=f"metrics of these points: {', '.join(known) or 'none'}")
    v = np.array([p.metrics[name] for p in points], float)
    return 1.0 - v if name != metric else v


def families(points: Sequence[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.family, []).append(p)
    return out


def flops_factor(points: Sequence[Point]) -> float:
    """f = C / (N · D), the median over the points (6 for a plain transformer counted as 6ND)."""
    return float(np.median([p.C / (p.N * p.D) for p in points]))


def budgets(points: Sequence[Point]) -> list[tuple[float, list[Point]]]:
    """The IsoFLOP budgets, smallest first: the ``budget`` column where given, else the points'
    C clustered within BUDGET_TOLERANCE; each budget is named by its geometric-mean C."""
    if all(p.budget is not None for p in points):
        keyed: dict[float, list[Point]] = {}
        for p in points:
            keyed.setdefault(float(p.budget), []).append(p)  # type: ignore[arg-type]
        return sorted(keyed.items())
    groups: list[list[Point]] = []
    for p in sorted(points, key=lambda q: q.C):
        if groups and p.C <= groups[-1][0].C * (1 + BUDGET_TOLERANCE):
            groups[-1].append(p)
        else:
            groups.append([p])
    return [(float(np.exp(np.mean([np.log(q.C) for q in g]))), g) for g in groups]


def isoflop(points: Sequence[Point], metric: str) -> dict[str, Any]:
    """Per budget with 3 or more points a parabola of the metric against ln N, its vertex, N_opt,
    D_opt; the power laws N_opt ∝ C^a, D_opt ∝ C^b when two or more budgets have a minimum."""
    f = flops_factor(points)
    rows, skipped = [], []
    for C, group in budgets(points):
        if len({p.N for p in group}) < 3:
            skipped.append({"budget": C, "points": len(group), "why": "fewer than 3 sizes"})
            continue
        x = np.log([p.N for p in group])
        y = values(group, metric)
        a, b, c = np.polyfit(x, y, 2)
        resid = y - np.polyval([a, b, c], x)
        if not a > 0:
            skipped.append({"budget": C, "points": len(group), "why": "no minimum (the parabola opens downward)"})
            continue
        xo = -b / (2 * a)
        inside = bool(x.min() <= xo <= x.max())
        rows.append({"budget": C, "points": len(group), "coef": [float(a), float(b), float(c)],
                     "N_opt": float(np.exp(xo)), "D_opt": float(C / (f * np.exp(xo))),
                     "min": float(np.polyval([a, b, c], xo)), "rmse": float(np.sqrt(np.mean(resid ** 2))),
                     "inside": inside, "sizes": [float(v) for v in np.exp(x)], "values": [float(v) for v in y]})
    out: dict[str, Any] = {"flops_per_param_token": f, "budgets": rows, "skipped": skipped}
    if len(rows) >= 2:
        lc = np.log([r["budget"] for r in rows])
        out["N_opt_exponent"], ln_kn = (float(v) for v in np.polyfit(lc, np.log([r["N_opt"] for r in rows]), 1))
        out["D_opt_exponent"], ln_kd = (float(v) for v in np.polyfit(lc, np.log([r["D_opt"] for r in rows]), 1))
        out["N_opt_coef"], out["D_opt_coef"] = float(np.exp(ln_kn)), float(np.exp(ln_kd))
    return out


def _interval(xs: np.ndarray, level: float = 0.90) -> list[float]:
    """The percentile interval; with infinite values (resamples that never reach the loss) the
    nearest order statistics, so an unbounded end is inf rather than nan."""
    q = [50 * (1 - level), 50 * (1 + level)]
    if np.all(np.isfinite(xs)):
        lo, hi = np.percentile(xs, q)
    else:
        lo, hi = np.percentile(xs, q[0], method="lower"), np.percentile(xs, q[1], method="higher")
    return [float(lo), float(hi)]


@dataclass
class FamilyFit:
    """One family's joint law, its bootstrap laws and the FLOPs factor of its runs."""

    name: str
    points: list[Point]
    law: Law
    boot: list[Law]
    f: float

    def report(self) -> dict[str, Any]:
        ci: dict[str, list[float]] = {}
        if self.boot:
            for k in ("E", "A", "B", "alpha", "beta"):
                ci[k] = _interval(np.array([getattr(b, k) for b in self.boot]))
        return {"points": len(self.points), "flops_per_param_token": self.f, "law": self.law.to_dict(),
                "ci90": ci, "resamples": len(self.boot), "exponents": {
                    "N_opt": self.law.beta / (self.law.alpha + self.law.beta),
                    "D_opt": self.law.alpha / (self.law.alpha + self.law.beta)}}


def fit_family(name: str, points: list[Point], opts: FitOptions, rng: np.random.Generator) -> FamilyFit:
    N, D = np.array([p.N for p in points]), np.array([p.D for p in points])
    y = values(points, opts.metric)
    try:
        law = fit_law(N, D, y, starts=opts.starts)
    except UserError as e:
        raise UserError(f"family {name!r}: {e.problems[0]}", hint=e.hint) from None
    boot = bootstrap_laws(N, D, y, law, opts.resamples, rng) if opts.resamples > 0 else []
    return FamilyFit(name=name, points=points, law=law, boot=boot, f=flops_factor(points))


def reference_budget(points: Sequence[Point]) -> float:
    """The default budget of the multiplier: the geometric middle of the points' C, where the law
    is best constrained (at the largest budget the frontier's optimum lies at the edge of the data)."""
    cs = [p.C for p in points]
    return float(np.sqrt(min(cs) * max(cs)))


def _ratio(fam: Law, f_fam: float, base: Law, f_base: float, at_loss: float | None, at_budget: float) -> tuple[float, float]:
    """(C_base(L) / C_fam(L), L) with L the given loss or fam's frontier at at_budget."""
    L = at_loss if at_loss is not None else float(fam.frontier(at_budget, f_fam))
    c_fam = fam.compute_for(L, f_fam)
    return base.compute_for(L, f_base) / c_fam if np.isfinite(c_fam) else float("nan"), L


def multiplier(fam: FamilyFit, base: FamilyFit, at_loss: float | None = None,
               at_budget: float | None = None) -> dict[str, Any]:
    """The compute multiplier of ``fam`` against ``base`` at equal loss, with its 90% bootstrap interval."""
    C_ref = at_budget if at_budget is not None else reference_budget(fam.points)
    value, L = _ratio(fam.law, fam.f, base.law, base.f, at_loss, C_ref)
    if not np.isfinite(value):
        who = base.name if np.isfinite(fam.law.compute_for(L, fam.f)) else fam.name
        raise UserError(f"the multiplier is undefined: family {who!r}'s fitted law never reaches loss {L:.4g} "
                        f"(its irreducible loss E)", hint="pick a higher --at-loss or a smaller --at-budget")
    out: dict[str, Any] = {"family": fam.name, "baseline": base.name, "loss": L,
                           "budget": None if at_loss is not None else C_ref, "value": value,
                           "C_family": fam.law.compute_for(L, fam.f), "C_baseline": base.law.compute_for(L, base.f)}
    # the same read at each of the family's budgets: a constant multiplier, or one that grows with C
    out["by_budget"] = [{"budget": c, "value": _ratio(fam.law, fam.f, base.law, base.f, None, c)[0]}
                        for c, _ in budgets(fam.points)] if at_loss is None else []
    k = min(len(fam.boot), len(base.boot))
    if k:
        r = np.array([_ratio(a, fam.f, b, base.f, at_loss, C_ref)[0] for a, b in zip(fam.boot[:k], base.boot[:k])])
        r = np.where(np.isnan(r), np.inf, r)  # a resample whose law never reaches L: unbounded
        out["ci90"] = _interval(r)
        out["resamples"], out["unreachable"] = k, int(np.sum(~np.isfinite(r)))
    return out


def check_holdout(points: Sequence[Point], names: Sequence[str]) -> None:
    unknown = sorted(set(names) - {p.name for p in points})
    if unknown:
        raise UserError(f"--holdout: no point named {unknown[0]!r}",
                        hint="point names are run directories, or a table's name column")


def _holdout(points: list[Point], names: Sequence[str]) -> tuple[list[Point], list[Point], float | None]:
    """(fitted on, held out, the held-out budget): the named points of this family, else its largest budget."""
    if names:
        held = [p for p in points if p.name in names]
        if not held:
            raise UserError("--holdout names no point of this family")
        return [p for p in points if p.name not in names], held, None
    groups = budgets(points)
    if len(groups) < 2:
        raise UserError("the extrapolation check needs two or more budgets (one to hold out)")
    C, held = groups[-1]
    return [p for g in groups[:-1] for p in g[1]], held, C


def extrapolation(points: list[Point], opts: FitOptions) -> dict[str, Any]:
    """Hold out the largest budget (or opts.holdout), fit the law on the rest, predict the held-out
    points; the log-linear prediction of the held-out budget's best loss beside it."""
    train, held, C = _holdout(points, opts.holdout)
    if not held:
        raise UserError("the extrapolation check holds out no point")
    y_train, y_held = values(train, opts.metric), values(held, opts.metric)
    try:
        law = fit_law([p.N for p in train], [p.D for p in train], y_train, starts=opts.starts)
    except UserError as e:
        raise UserError(f"extrapolation check: {e.problems[0]}", hint=e.hint) from None
    pred = law.loss(np.array([p.N for p in held]), np.array([p.D for p in held]))
    rows = [{"name": p.name, "N": p.N, "D": p.D, "C": p.C, "measured": float(m), "predicted": float(q)}
            for p, m, q in zip(held, y_held, pred)]
    best = int(np.argmin(y_held))
    out: dict[str, Any] = {"held_out": rows, "fitted_on": len(train), "law": law.to_dict(),
                           "mean_abs_error": float(np.mean(np.abs(pred - y_held))),
                           "best": {"name": held[best].name, "measured": float(y_held[best]),
                                    "predicted": float(pred[best]), "error": float(pred[best] - y_held[best])}}
    train_budgets = budgets(train)
    if len(train_budgets) >= 2:
        lc = np.log([c for c, _ in train_budgets])
        lbest = np.log([values(g, opts.metric).min() for _, g in train_budgets])
        slope, icpt = np.polyfit(lc, lbest, 1)
        c_held = C if C is not None else float(held[best].C)
        naive = float(np.exp(icpt + slope * np.log(c_held)))
        out["log_linear"] = {"predicted": naive, "error": naive - float(y_held[best]), "slope": float(slope)}
    return out


def analyse(points: list[Point], opts: FitOptions, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """Every analysis the points allow, as one JSON-able report (see the module docstring)."""
    rng = rng if rng is not None else np.random.default_rng(opts.seed)
    values(points, opts.metric)  # an unknown metric is refused before any fit
    fams = families(points)
    pair = _pair(list(fams), opts)  # a misnamed family or point, or a missing column, is refused before any fit
    check_holdout(points, opts.holdout)
    if opts.dlcm:
        _column(points, "R", "--dlcm"), _column(points, "P", "--dlcm")
    fits = {name: fit_family(name, pts, opts, rng) for name, pts in fams.items()}
    report: dict[str, Any] = {"metric": opts.metric, "points": len(points), "families": {}}
    for name, ff in fits.items():
        rep = ff.report()
        rep["isoflop"] = isoflop(ff.points, opts.metric)
        try:
            rep["extrapolation"] = extrapolation(ff.points, opts)
        except UserError as e:  # too few budgets or points for this family: the others still get theirs
            rep["extrapolation"] = {"skipped": e.problems[0]}
        rep.update(_dlcm_parts(ff.points, opts))
        report["families"][name] = rep
    if pair is not None:
        fam, base = pair
        report["multiplier"] = multiplier(fits[fam], fits[base], opts.at_loss, opts.at_budget)
    return report


def _column(points: Sequence[Point], col: str, why: str) -> np.ndarray:
    missing = [p.name for p in points if col not in p.metrics]
    if missing:
        raise UserError(f"{why} needs the column {col!r} for every point ({missing[0]} has none)")
    return np.array([p.metrics[col] for p in points], float)


def _dlcm_parts(points: Sequence[Point], opts: FitOptions) -> dict[str, Any]:
    """With opts.dlcm, Eq. 22 (columns R and P); when the points carry ``stable_loss`` (the loss at
    the end of the WSD stable phase; the metric is then the decayed loss), the decay-phase law."""
    from ncpctl.study.dlcm import fit_dlcm, fit_decay

    out: dict[str, Any] = {}
    N, D = np.array([p.N for p in points]), np.array([p.D for p in points])
    y = values(points, opts.metric)
    if opts.dlcm:
        R, P = _column(points, "R", "--dlcm"), _column(points, "P", "--dlcm")
        law = fit_dlcm(N, D, R, P, y, starts=opts.starts, seed=opts.seed)
        out["dlcm"] = {"law": law.to_dict(), "rmse": float(np.sqrt(np.mean((law.loss(N, D, R, P) - y) ** 2)))}
    if any("stable_loss" in p.metrics for p in points):
        R = np.array([p.metrics.get("R", 1.0) for p in points])
        out["decay"] = fit_decay(_column(points, "stable_loss", "the decay-phase law"), y, R, N).to_dict()
    return out


def _pair(names: list[str], opts: FitOptions) -> tuple[str, str] | None:
    """(family, baseline) of the multiplier: as named, or the two families when there are two."""
    for given in (opts.baseline, opts.family):
        if given is not None and given not in names:
            raise UserError(f"no family named {given!r}", hint=f"families: {', '.join(names)}")
    if opts.baseline is None and opts.family is None:
        return (names[1], names[0]) if len(names) == 2 else None
    others = [n for n in names if n not in (opts.baseline, opts.family)]
    base = opts.baseline if opts.baseline is not None else (others[0] if len(others) == 1 else None)
    fam = opts.family if opts.family is not None else (others[0] if len(others) == 1 else None)
    if base is None or fam is None or base == fam:
        raise UserError("the multiplier needs two different families: name them with --family and --baseline",
                        hint=f"families: {', '.join(names)}")
    return fam, base
