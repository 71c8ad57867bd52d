"""Scaling-law analyses of a set of runs (``ncpctl fit``): IsoFLOP parabolas, the joint law per
family with bootstrap intervals, compute multipliers between two families, an extrapolation check.

Compute is counted one way everywhere (``ncpctl.model.accounting.flops.FLOP_CONVENTION``: every
attention score, as budgets and MFU count it), and each family's shapes at their exact cost per
token (``ncpctl.study.cost``): C / (N D) is not one constant per family.

* IsoFLOP (Hoffmann et al.'s approach 2, ``ncpctl.study.isoflop``): per budget, the metric against
  x = ln N as a parabola; its vertex gives N_opt, D_opt = C / c(N_opt); N_opt ∝ C^a over the
  vertices inside the sampled sizes, with bootstrap intervals; the envelope of the minima.
* The joint law (approach 3, ``ncpctl.study.law``) per family, with percentile intervals over
  ``resamples`` bootstrap refits (points drawn with replacement within the family, each refitted
  from the grid). A law of fewer than twice its 5 parameters' points is refused; one of fewer than
  three times, or with an estimate at a bound, is reported with a caution.
* The compute multiplier of ``family`` against ``baseline`` at equal loss: C_baseline(L) /
  C_family(L), where C_x(L) is the compute at which x's fitted frontier (minimised over N under its
  exact per-shape cost) reaches L; L is the ``family``'s frontier at a reference budget (default
  the geometric middle of its runs' C, ``reference_budget``), or a given loss. Above 1: the baseline
  needs that many times the compute of ``family`` for the same loss. Its interval pairs the two
  families' bootstrap laws resample by resample (the reference loss recomputed from each); a
  resample whose family never reaches L counts as 0, one whose baseline never does as inf, one where
  neither does is left out (each counted). Beside it, approach 2's multiplier from the envelopes.
* The extrapolation check: the points of the largest budget (or named points) held out, the law
  fitted on the rest predicts them; beside it, the naive log-linear law of the best loss per
  budget against C (a straight line in log-log through the other budgets).
* ``exclude_embeddings``: N and C without the embeddings and the LM head (``N_nonembedding``,
  ``C_nonembedding``: ``ncpctl.study.run_columns``), the Kaplan et al. convention NCP-ArchPreview's
  C follows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ncpctl.errors import UserError
from ncpctl.study.cost import Cost
from ncpctl.study.isoflop import IsoFit, envelope_multiplier, fit_isoflop
from ncpctl.study.law import EXPONENT_BOUNDS, FIRM_POINTS, N_PARAMS, Law, bootstrap_laws, fit_law
from ncpctl.study.points import Point, budgets, families, values

__all__ = ["FitOptions", "FamilyFit", "analyse", "budgets", "extrapolation", "families", "fit_family", "isoflop",
           "multiplier", "values"]


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
    exclude_embeddings: bool = False  # N and C without the embeddings and LM head


def isoflop(points: Sequence[Point], metric: str) -> dict[str, Any]:
    """The IsoFLOP report of points (no bootstrap): ``ncpctl.study.isoflop.fit_isoflop``."""
    return fit_isoflop(points, metric).report


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
    """One family's joint law, its bootstrap laws and the exact per-shape cost of its runs."""

    name: str
    points: list[Point]
    law: Law
    boot: list[Law]
    cost: Cost
    metric: str = "loss"

    @property
    def f(self) -> float:
        """The median C / (N D) of the shapes (a summary; the frontier uses ``cost``)."""
        return self.cost.median_factor

    def report(self) -> dict[str, Any]:
        ci: dict[str, list[float]] = {}
        a = self.law.beta / (self.law.alpha + self.law.beta)
        exps: dict[str, Any] = {"N_opt": a}  # D_opt ∝ C^(1−a) where C ∝ N·D: not a second result
        if self.boot:
            for k in ("E", "A", "B", "alpha", "beta"):
                ci[k] = _interval(np.array([getattr(b, k) for b in self.boot]))
            exps["ci90"] = _interval(np.array([b.beta / (b.alpha + b.beta) for b in self.boot if b.alpha + b.beta > 0]))
        return {"points": len(self.points), "flops_per_param_token": self.f, "cost": self.cost.to_dict(),
                "law": self.law.to_dict(), "ci90": ci, "resamples": len(self.boot), "exponents": exps,
                "cautions": cautions(self.law, ci, len(self.points), float(values(self.points, self.metric).min()))}


def cautions(law: Law, ci: dict[str, list[float]], n: int, values_min: float) -> list[str]:
    """Why a fitted joint law is less sure than its table looks: few points for its parameters, an
    estimate at a bound (an exponent at 0 or 5, E collapsed to 0), an interval with no width."""
    out = []
    if n < FIRM_POINTS:
        out.append(f"{n} points for the law's {N_PARAMS} parameters (fewer than {FIRM_POINTS}): the law and its "
                   "intervals are loosely determined")
    for k, sym in (("alpha", "α"), ("beta", "β")):
        v = getattr(law, k)
        bound = next((b for b in EXPONENT_BOUNDS if abs(v - b) < 1e-6), None)
        if bound is not None:
            out.append(f"{sym} = {v:.3g} sits at its bound {bound:g}: the data do not determine it")
    if law.E < 1e-6 * values_min:
        out.append(f"E = {law.E:.3g} collapsed to 0 (its bound): the fit finds no floor under the loss")
    flat = [k for k, (lo, hi) in ci.items() if hi - lo <= 1e-9 * max(abs(hi), 1e-300)]
    if flat:
        out.append(f"the bootstrap interval of {', '.join(flat)} has no width: the resamples could not move the "
                   "fit, not a sure estimate")
    return out


def fit_family(name: str, points: list[Point], opts: FitOptions, rng: np.random.Generator) -> FamilyFit:
    N, D = np.array([p.N for p in points]), np.array([p.D for p in points])
    y = values(points, opts.metric)
    try:
        law = fit_law(N, D, y, starts=opts.starts)
    except UserError as e:
        raise UserError(f"family {name!r}: {e.problems[0]}", hint=e.hint) from None
    boot = bootstrap_laws(N, D, y, law, opts.resamples, rng, starts=opts.starts) if opts.resamples > 0 else []
    return FamilyFit(name=name, points=points, law=law, boot=boot, cost=Cost.of(points), metric=opts.metric)


def reference_budget(points: Sequence[Point]) -> float:
    """The default budget of the multiplier: the geometric middle of the points' C, where the law
    is best constrained (at the largest budget the frontier's optimum lies at the edge of the data)."""
    cs = [p.C for p in points]
    return float(np.sqrt(min(cs) * max(cs)))


def _computes(fam: Law, fam_cost: Cost, base: Law, base_cost: Cost, at_loss: float | None,
              at_budget: float) -> tuple[float, float, float]:
    """(C_fam(L), C_base(L), L) with L the given loss or fam's frontier at at_budget."""
    L = at_loss if at_loss is not None else fam_cost.frontier(fam, at_budget)
    return fam_cost.compute_for(fam, L), base_cost.compute_for(base, L), L


def multiplier(fam: FamilyFit, base: FamilyFit, at_loss: float | None = None,
               at_budget: float | None = None) -> dict[str, Any]:
    """The compute multiplier of ``fam`` against ``base`` at equal loss, with its 90% bootstrap interval."""
    C_ref = at_budget if at_budget is not None else reference_budget(fam.points)
    c_fam, c_base, L = _computes(fam.law, fam.cost, base.law, base.cost, at_loss, C_ref)
    if not (np.isfinite(c_fam) and np.isfinite(c_base)):
        who = fam.name if not np.isfinite(c_fam) else base.name
        raise UserError(f"the multiplier is undefined: family {who!r}'s fitted law never reaches loss {L:.4g} "
                        f"(its irreducible loss E)", hint="pick a higher --at-loss or a smaller --at-budget")
    out: dict[str, Any] = {"family": fam.name, "baseline": base.name, "loss": L,
                           "budget": None if at_loss is not None else C_ref, "value": c_base / c_fam,
                           "C_family": c_fam, "C_baseline": c_base}
    # the same read at each of the family's IsoFLOP budgets (3 or more points): a constant multiplier, or
    # one that grows with C
    out["by_budget"] = [{"budget": c, "value": (lambda cf, cb, _: cb / cf)(*_computes(
        fam.law, fam.cost, base.law, base.cost, None, c))} for c, g in budgets(fam.points)
        if len(g) >= 3] if at_loss is None else []
    k = min(len(fam.boot), len(base.boot))
    if k:
        cf, cb = np.array([_computes(a, fam.cost, b, base.cost, at_loss, C_ref)[:2]
                           for a, b in zip(fam.boot[:k], base.boot[:k])]).T
        fam_fails, base_fails = ~np.isfinite(cf), ~np.isfinite(cb)
        # the family never reaches L: infinitely worse (0); the baseline never does: infinitely better
        # (inf); neither: no comparison, left out
        r = np.where(fam_fails, 0.0, cb / np.where(fam_fails, 1.0, cf))
        keep = ~(fam_fails & base_fails)
        if keep.any():
            out["ci90"] = _interval(r[keep])
        out["resamples"] = k
        out["unreachable"] = {"family": int((fam_fails & ~base_fails).sum()),
                              "baseline": int((base_fails & ~fam_fails).sum()), "both": int((fam_fails & base_fails).sum())}
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
    from ncpctl.model.accounting.flops import FLOP_CONVENTION

    rng = rng if rng is not None else np.random.default_rng(opts.seed)
    values(points, opts.metric)  # an unknown metric is refused before any fit
    if opts.exclude_embeddings:
        points = nonembedding(points)
    fams = families(points)
    pair = _pair(list(fams), opts)  # a misnamed family or point, or a missing column, is refused before any fit
    check_holdout(points, opts.holdout)
    if opts.dlcm:
        _column(points, "R", "--dlcm"), _column(points, "P", "--dlcm")
    fits = {name: fit_family(name, pts, opts, rng) for name, pts in fams.items()}
    report: dict[str, Any] = {"metric": opts.metric, "points": len(points), "flop_convention": FLOP_CONVENTION,
                              "N_C": "non-embedding" if opts.exclude_embeddings else "all parameters and FLOPs",
                              "families": {}, "warnings": repetition(points)}
    isos: dict[str, IsoFit] = {}
    iso_rng = np.random.default_rng([opts.seed, 1])  # the joint law's draws stay those of the seed
    for name, ff in fits.items():
        rep = ff.report()
        isos[name] = fit_isoflop(ff.points, opts.metric, ff.cost, opts.resamples, iso_rng)
        rep["isoflop"] = isos[name].report
        try:
            rep["extrapolation"] = extrapolation(ff.points, opts)
        except UserError as e:  # too few budgets or points for this family: the others still get theirs
            rep["extrapolation"] = {"skipped": e.problems[0]}
        rep.update(_dlcm_parts(ff.points, opts))
        report["families"][name] = rep
    if pair is not None:
        fam, base = pair
        m = report["multiplier"] = multiplier(fits[fam], fits[base], opts.at_loss, opts.at_budget)
        unsure = [n for n in pair if report["families"][n]["cautions"]]
        if unsure:
            m["caution"] = (f"the law of {' and '.join(unsure)} comes with a caution (above): the interval is surer "
                            "than the data")
        C_ref = opts.at_budget if opts.at_budget is not None else reference_budget(fits[fam].points)
        report["multiplier_isoflop"] = envelope_multiplier(fam, isos[fam], base, isos[base], opts.at_loss, C_ref)
    return report


def nonembedding(points: Sequence[Point]) -> list[Point]:
    """The points with N and C without the embeddings and the LM head (``--exclude-embeddings``)."""
    missing = [p.name for p in points if not {"N_nonembedding", "C_nonembedding"} <= set(p.settings)]
    if missing:
        raise UserError(f"--exclude-embeddings needs the columns N_nonembedding and C_nonembedding for every point "
                        f"({missing[0]} has none)", hint="run directories carry them; a table needs the two columns")
    return [dataclasses.replace(p, N=p.settings["N_nonembedding"], C=p.settings["C_nonembedding"]) for p in points]


def repetition(points: Sequence[Point]) -> list[str]:
    """A warning when points train on their data more than once (``epochs`` above 1)."""
    over = sorted((p.settings["epochs"], p.name) for p in points if p.settings.get("epochs", 0.0) > 1.0)
    if not over:
        return []
    return [f"{len(over)} point(s) repeat their training data (epochs over the training split up to "
            f"{over[-1][0]:.2f}, {over[-1][1]}): repeated tokens are worth less than fresh ones, the law assumes fresh"]


def _column(points: Sequence[Point], col: str, why: str) -> np.ndarray:
    missing = [p.name for p in points if p.column(col) is None]
    if missing:
        raise UserError(f"{why} needs the column {col!r} for every point ({missing[0]} has none)")
    return np.array([p.column(col) for p in points], float)


def _dlcm_parts(points: Sequence[Point], opts: FitOptions) -> dict[str, Any]:
    """With opts.dlcm, Eq. 22 (columns R and P); when the points carry ``stable_METRIC`` (``stable_loss``:
    the loss at the end of the WSD stable phase; the metric is then the decayed loss), the decay-phase law."""
    from ncpctl.study.dlcm import fit_dlcm, fit_decay

    out: dict[str, Any] = {}
    N, D = np.array([p.N for p in points]), np.array([p.D for p in points])
    y = values(points, opts.metric)
    if opts.dlcm:
        R, P = _column(points, "R", "--dlcm"), _column(points, "P", "--dlcm")
        # DLCM's N leaves out the embeddings, and a run directory's P is a share of that N
        Nd = N if any(p.column("N_nonembedding") is None for p in points) else _column(points, "N_nonembedding", "")
        law = fit_dlcm(Nd, D, R, P, y, starts=opts.starts, seed=opts.seed)
        out["dlcm"] = {"law": law.to_dict(), "rmse": float(np.sqrt(np.mean((law.loss(Nd, D, R, P) - y) ** 2))),
                       "N": "non-embedding" if Nd is not N else "N"}
    name = opts.metric[2:] if opts.metric.startswith("1-") else opts.metric
    col = f"stable_{name}"
    if any(p.column(col) is not None for p in points):
        R = np.array([p.column("R") or 1.0 for p in points])
        stable = _column(points, col, "the decay-phase law")
        out["decay"] = fit_decay(1.0 - stable if name != opts.metric else stable, y, R, N).to_dict()
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
