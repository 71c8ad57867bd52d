"""Synthetic runs drawn from a known law, for the tests of ``ncpctl fit`` and bench/fit_coverage.py.

``CHINCHILLA`` is Hoffmann et al.'s fitted law (E 1.69, A 406.4, B 410.7, α 0.34, β 0.28). A family
with a compute multiplier m over a law (``faster``) reaches at every C what the law reaches at
m · C: it is the law with the data term's B scaled by m^(−β) (L'(N, D) = L(N, m D)), so its
frontier is L*(m C) and the multiplier is m at every loss.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ncpctl.study.law import Law
from ncpctl.study.points import Point

CHINCHILLA = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
F_6ND = 6.0


def faster(law: Law, m: float) -> Law:
    """The law of a family that needs 1/m of ``law``'s compute for any loss."""
    return dataclasses.replace(law, B=law.B * m ** (-law.beta))


def grid_points(law: Law, family: str, rng: np.random.Generator, noise: float = 0.01,
                sizes: tuple[float, float] = (1e7, 1e9), tokens: tuple[float, float] = (1e9, 1e11),
                n: int = 5) -> list[Point]:
    """An n x n grid of N and D (log-spaced), C = 6 N D, the loss with Gaussian noise of ``noise`` nats."""
    N, D = (x.ravel() for x in np.meshgrid(np.geomspace(*sizes, n), np.geomspace(*tokens, n)))
    L = law.loss(N, D) + rng.normal(0.0, noise, N.shape)
    return [Point(family=family, N=float(a), D=float(b), C=F_6ND * a * b, metrics={"loss": float(y)},
                  name=f"{family}/N{a:.3g}-D{b:.3g}") for a, b, y in zip(N, D, L)]


def isoflop_points(law: Law, family: str, rng: np.random.Generator, budgets: tuple[float, ...],
                   noise: float = 0.01, sizes: int = 5, spread: float = 4.0) -> list[Point]:
    """Per budget C, ``sizes`` model sizes log-spaced over a factor ``spread`` either side of the
    law's optimal N, D = C / (6 N), the loss with Gaussian noise."""
    out = []
    for C in budgets:
        n_opt = float(law.optimal(C, F_6ND)[0])
        for N in n_opt * np.geomspace(1 / spread, spread, sizes):
            D = C / (F_6ND * N)
            y = float(law.loss(N, D)) + float(rng.normal(0.0, noise))
            out.append(Point(family=family, N=float(N), D=float(D), C=float(C), metrics={"loss": y},
                             name=f"{family}/C{C:.3g}-N{N:.3g}", budget=float(C)))
    return out
