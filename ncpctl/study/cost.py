"""The exact training cost of a family's shapes, and a fitted law's compute-optimal frontier under it.

A point's compute is C = c(N) · D: c(N) the exact training FLOPs per token of its shape (full
attention counted, ``ncpctl.model.accounting.flops.FLOP_CONVENTION``). C / (N D) is not one constant per
family: the LM head, attention and a concept path cost per token what N alone does not say (the
tiny study's shapes span 4.60-5.96 for the base, 4.28-5.16 for ConceptLM). ``Cost`` keeps c at
each sampled shape (the median C / D of its points), interpolates it between the shapes in log-log
and extrapolates it beyond them along the end segments; the frontier is then minimised over N
under that cost, numerically:

    L*(C) = min_N L(N, C / c(N)),    C(L) the inverse (L* falls with C).

When c(N) = f · N at every shape (a table counted as 6ND) this is the closed form of
``ncpctl.study.law.Law.optimal`` and that is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ncpctl.study.law import Law

SPAN = np.log(1e4)  # the frontier's N is searched within 10^±4 of the constant-factor optimum (widened if needed)
GRID_POINTS = 801


@dataclass(frozen=True)
class Cost:
    """c(N), the training FLOPs per token, at the sampled sizes (ascending)."""

    sizes: tuple[float, ...]
    per_token: tuple[float, ...]

    @classmethod
    def of(cls, points: Sequence[Any]) -> "Cost":
        """The per-shape cost of points with N, D and C (one size per shape)."""
        by: dict[float, list[float]] = {}
        for p in points:
            by.setdefault(float(p.N), []).append(float(p.C) / float(p.D))
        sizes = sorted(by)
        return cls(tuple(sizes), tuple(float(np.median(by[n])) for n in sizes))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cost":
        return cls(tuple(d["sizes"]), tuple(d["per_token"]))

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "per_token": list(self.per_token), "factors": self.factors(),
                "constant_factor": self.factor}

    def factors(self) -> list[float]:
        """C / (N D) per shape."""
        return [c / n for n, c in zip(self.sizes, self.per_token)]

    @property
    def median_factor(self) -> float:
        return float(np.median(self.factors()))

    @property
    def factor(self) -> float | None:
        """f when c(N) = f · N at every shape (to 1e-9), else None."""
        f = np.array(self.factors())
        return float(f[0]) if np.all(np.abs(f / f[0] - 1) < 1e-9) else None

    def c(self, N: np.ndarray | float) -> np.ndarray:
        """FLOPs per token at N: log-log interpolation between the shapes, the end segments beyond."""
        x = np.log(np.asarray(N, float))
        xs, ys = np.log(self.sizes), np.log(self.per_token)
        if len(xs) == 1:  # one shape: c proportional to N
            return np.exp(ys[0] + x - xs[0])
        y = np.interp(x, xs, ys)
        lo, hi = (ys[1] - ys[0]) / (xs[1] - xs[0]), (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x < xs[0], ys[0] + lo * (x - xs[0]), y)
        return np.exp(np.where(x > xs[-1], ys[-1] + hi * (x - xs[-1]), y))

    # ---- the frontier of a law under this cost

    def optimal(self, law: Law, C: float) -> tuple[float, float]:
        """(N_opt, D_opt) at C FLOPs: argmin_N L(N, C / c(N))."""
        f = self.factor
        if f is not None:
            n, d = law.optimal(C, f)
            return float(n), float(d)
        x0 = float(np.log(law.optimal(C, self.median_factor)[0])) if law.alpha > 0 and law.beta > 0 else np.nan
        if not np.isfinite(x0):
            x0 = float(np.mean(np.log(self.sizes)))
        for _ in range(8):  # widen the window while the minimum sits at its edge
            xs = np.linspace(x0 - SPAN, x0 + SPAN, GRID_POINTS)
            Ns = np.exp(xs)
            y = law.loss(Ns, C / self.c(Ns))
            i = int(np.argmin(y))
            if 0 < i < GRID_POINTS - 1:
                break
            x0 = float(xs[i])
        else:
            return float(Ns[i]), float(C / self.c(Ns[i]))
        # a finer grid between the minimum's neighbours (ln N to 1e-5; the loss to ~1e-11): c(N) has a
        # kink at each shape, where the minimum often sits, so no parabola through the grid points
        fine = np.linspace(xs[i - 1], xs[i + 1], GRID_POINTS)
        Nf = np.exp(fine)
        n = float(Nf[int(np.argmin(law.loss(Nf, C / self.c(Nf))))])
        return n, float(C / self.c(n))

    def frontier(self, law: Law, C: float) -> float:
        """L*(C), the lowest loss reachable with C FLOPs under this cost."""
        n, d = self.optimal(law, C)
        return float(law.loss(n, d))

    def compute_for(self, law: Law, loss: float) -> float:
        """The C with L*(C) = loss (inf when the law never reaches it)."""
        f = self.factor
        if f is not None:
            return law.compute_for(loss, f)
        if not loss > law.E or law.alpha <= 0 or law.beta <= 0:
            return float("inf")
        from scipy.optimize import brentq

        guess = law.compute_for(loss, self.median_factor)
        lo, hi = np.log(guess) - 3.0, np.log(guess) + 3.0
        g = lambda lc: self.frontier(law, float(np.exp(lc))) - loss  # noqa: E731  (falls with C)
        for _ in range(60):
            if g(lo) > 0:
                break
            lo -= 5.0
        for _ in range(60):
            if g(hi) < 0:
                break
            hi += 5.0
        else:
            return float("inf")
        return float(np.exp(brentq(g, lo, hi, xtol=1e-12, rtol=1e-12)))
