"""Hoffmann et al.'s approach 2 (``ncpctl fit``'s IsoFLOP view): per budget, the metric against
x = ln N as a parabola; its vertex gives N_opt, and D_opt = C / c(N_opt) under the family's exact
per-shape cost (``ncpctl.study.cost``); then N_opt ∝ C^a by least squares in log-log, and D_opt ∝
C^(1−a) where C ∝ N·D (b = 1 − a: not a second result).

* A vertex outside the budget's sampled sizes is an extrapolation: flagged, and kept out of the
  exponent and the envelope.
* The parabola's residual RMSE is reported only where it has degrees of freedom (4 or more points
  for its 3 coefficients; through 3 points it is 0 by construction).
* Intervals (90%, percentile) on each N_opt, on a and on the envelope come from ``resamples``
  bootstrap draws of the points within each budget (a draw with fewer than 3 sizes, or whose vertex
  falls outside its sizes, leaves that budget out of that draw).
* The envelope of the minima, ln L_min = p + q ln C (a power law in C, as NCP-ArchPreview's Fig. 4
  draws the best loss per budget), gives the approach-2 compute multiplier between two families
  (``envelope_multiplier``), beside the joint law's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ncpctl.study.cost import Cost
from ncpctl.study.points import Point, budgets, values

MIN_SIZES = 3  # a parabola's three coefficients


def _vertex(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, bool] | None:
    """(coefficients, vertex x, inside the sizes) of the parabola through (x, y), None when it opens
    downward (no minimum)."""
    coef = np.polyfit(x, y, 2)
    if not coef[0] > 0:
        return None
    xo = float(-coef[1] / (2 * coef[0]))
    return coef, xo, bool(x.min() <= xo <= x.max())


@dataclass
class IsoFit:
    """One family's IsoFLOP analysis: ``report`` (JSON-able) and, per bootstrap draw, its envelope
    (p, q) (nan where the draw has fewer than two usable budgets)."""

    report: dict[str, Any]
    envelopes: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))


def _envelope(lc: np.ndarray, lmin: np.ndarray) -> tuple[float, float]:
    """(p, q) of ln L_min = p + q ln C through the finite rows (nan with fewer than two)."""
    ok = np.isfinite(lmin)
    if ok.sum() < 2:
        return float("nan"), float("nan")
    q, p = np.polyfit(lc[ok], lmin[ok], 1)
    return float(p), float(q)


def _slope(lc: np.ndarray, ly: np.ndarray) -> float:
    ok = np.isfinite(ly)
    return float(np.polyfit(lc[ok], ly[ok], 1)[0]) if ok.sum() >= 2 else float("nan")


def _interval(xs: np.ndarray, level: float = 0.90) -> list[float] | None:
    xs = xs[np.isfinite(xs)]
    return [float(v) for v in np.percentile(xs, [50 * (1 - level), 50 * (1 + level)])] if len(xs) else None


def fit_isoflop(points: Sequence[Point], metric: str, cost: Cost | None = None, resamples: int = 0,
            rng: np.random.Generator | None = None) -> IsoFit:
    """The parabolas, N_opt per budget, the exponent a and the envelope, with bootstrap intervals."""
    cost = cost if cost is not None else Cost.of(points)
    rows, skipped, groups = [], [], []
    for C, group in budgets(points):
        if len({p.N for p in group}) < MIN_SIZES:
            skipped.append({"budget": C, "points": len(group), "why": f"fewer than {MIN_SIZES} sizes"})
            continue
        x, y = np.log([p.N for p in group]), values(group, metric)
        v = _vertex(x, y)
        if v is None:
            skipped.append({"budget": C, "points": len(group), "why": "no minimum (the parabola opens downward)"})
            continue
        coef, xo, inside = v
        dof = len(group) - MIN_SIZES
        rmse = float(np.sqrt(np.mean((y - np.polyval(coef, x)) ** 2))) if dof > 0 else None
        rows.append({"budget": C, "points": len(group), "coef": [float(c) for c in coef], "N_opt": float(np.exp(xo)),
                     "D_opt": float(C / cost.c(np.exp(xo))), "min": float(np.polyval(coef, xo)), "rmse": rmse,
                     "dof": dof, "inside": inside, "sizes": [float(n) for n in np.exp(x)],
                     "values": [float(t) for t in y]})
        groups.append((x, y))
    out: dict[str, Any] = {"flops_per_param_token": cost.median_factor, "budgets": rows, "skipped": skipped,
                           "outside": [r["budget"] for r in rows if not r["inside"]]}
    used = [r for r in rows if r["inside"]]
    if len(used) >= 2:
        lc = np.log([r["budget"] for r in used])
        out["N_opt_exponent"], ln_k = (float(v) for v in np.polyfit(lc, np.log([r["N_opt"] for r in used]), 1))
        out["N_opt_coef"] = float(np.exp(ln_k))
        p, q = _envelope(lc, np.log([r["min"] for r in used]))
        out["envelope"] = {"intercept": p, "slope": q, "budgets": len(used)}
    fit = IsoFit(out)
    if resamples > 0 and rows:
        _bootstrap(fit, rows, groups, resamples, rng if rng is not None else np.random.default_rng(0))
    return fit


def _bootstrap(fit: IsoFit, rows: list[dict[str, Any]], groups: list[tuple[np.ndarray, np.ndarray]],
               resamples: int, rng: np.random.Generator) -> None:
    """Per draw and budget, the points drawn with replacement and the parabola refitted: N_opt and the
    minimum of each budget (nan where unusable), then per draw the exponent and the envelope."""
    xo = np.full((resamples, len(rows)), np.nan)  # (B, budgets) ln N_opt
    lmin = np.full((resamples, len(rows)), np.nan)  # (B, budgets) ln of the minimum
    for j, (x, y) in enumerate(groups):
        idx = rng.integers(0, len(x), size=(resamples, len(x)))  # (B, n)
        for b in range(resamples):
            xb, yb = x[idx[b]], y[idx[b]]
            if len(np.unique(xb)) < MIN_SIZES:
                continue
            v = _vertex(xb, yb)
            if v is not None and v[2]:
                xo[b, j], lmin[b, j] = v[1], np.log(np.polyval(v[0], v[1]))
    lc = np.log([r["budget"] for r in rows])
    for j, r in enumerate(rows):
        r["N_opt_ci90"] = _interval(np.exp(xo[:, j]))
        r["resamples_used"] = int(np.isfinite(xo[:, j]).sum())
    a = np.array([_slope(lc, xo[b]) for b in range(resamples)])
    fit.report["ci90"] = {"N_opt_exponent": _interval(a)}
    fit.report["resamples"], fit.report["resamples_used"] = resamples, int(np.isfinite(a).sum())
    fit.envelopes = np.array([_envelope(lc, lmin[b]) for b in range(resamples)])  # (B, 2)


def _compute_at(env: tuple[float, float], loss: float) -> float:
    p, q = env
    return float(np.exp((np.log(loss) - p) / q)) if q < 0 else float("nan")


def envelope_multiplier(fam: str, fam_iso: IsoFit, base: str, base_iso: IsoFit, at_loss: float | None,
                        at_budget: float) -> dict[str, Any]:
    """Approach 2's compute multiplier of ``fam`` against ``base``: C_base(L) / C_fam(L) read off the
    envelopes of the IsoFLOP minima, at L = ``at_loss`` or fam's envelope at ``at_budget``; its 90%
    interval pairs the two families' bootstrap envelopes draw by draw (draws without one excluded)."""
    envs = {}
    for name, iso in ((fam, fam_iso), (base, base_iso)):
        e = iso.report.get("envelope")
        if e is None or not e["slope"] < 0:
            why = ("fewer than two budgets with a minimum inside the sizes" if e is None
                   else "its minima do not fall with C")
            return {"skipped": f"family {name!r}: {why}"}
        envs[name] = (e["intercept"], e["slope"])
    L = at_loss if at_loss is not None else float(np.exp(envs[fam][0] + envs[fam][1] * np.log(at_budget)))
    c_fam, c_base = _compute_at(envs[fam], L), _compute_at(envs[base], L)
    out: dict[str, Any] = {"family": fam, "baseline": base, "loss": L, "budget": None if at_loss is not None else at_budget,
                           "value": c_base / c_fam, "C_family": c_fam, "C_baseline": c_base}
    k = min(len(fam_iso.envelopes), len(base_iso.envelopes))
    if k:
        r = []
        for ef, eb in zip(fam_iso.envelopes[:k], base_iso.envelopes[:k]):
            if not (np.all(np.isfinite(ef)) and np.all(np.isfinite(eb))):
                continue
            lb = at_loss if at_loss is not None else float(np.exp(ef[0] + ef[1] * np.log(at_budget)))
            r.append(_compute_at(tuple(eb), lb) / _compute_at(tuple(ef), lb))
        out["ci90"], out["resamples"], out["resamples_used"] = _interval(np.array(r)), k, int(np.isfinite(r).sum())
    return out
