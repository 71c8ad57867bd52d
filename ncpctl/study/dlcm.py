"""DLCM's scaling law (Sec. 6.2, Eq. 22) and its decay-phase law (Sec. 6.2.3).

Eq. 22 splits the parameters N into the token layers' N (1 − P) and the concept layers' N P
(P: the concept share) and adds the compression R (tokens per concept):

    L(N, D, R, P) = E0 + A_tok / [N (1 − P) + t_tok]^δ1 + A_con R^γ / [N P + t_con]^δ2
                       + A_data / [D + t_data]^α

eleven parameters, fitted as the Chinchilla law is (``ncpctl.study.law``): a Huber loss on the
log residuals, L-BFGS-B from several starts, the best kept. A, E0 and the offsets t are fitted
as logarithms (positive), δ1, δ2, α in [0, 3], γ in [−3, 3].

The decay-phase law: under a WSD schedule the loss falls by Δ = L_stable − L_decayed in the
decay phase, and DLCM fits Δ = k L_stable^a R^b N^c by least squares in log space
(``fit_decay``; R² reported, 0.93 in the paper).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from ncpctl.errors import UserError

NAMES = ("E0", "A_tok", "t_tok", "delta1", "A_con", "gamma", "t_con", "delta2", "A_data", "t_data", "alpha")
LOGGED = ("E0", "A_tok", "t_tok", "A_con", "t_con", "A_data", "t_data")  # fitted as logarithms
BOUNDS = {"E0": (-3.0, 3.0), "A_tok": (-5.0, 40.0), "t_tok": (0.0, 30.0), "delta1": (0.0, 3.0),
          "A_con": (-5.0, 40.0), "gamma": (-3.0, 3.0), "t_con": (0.0, 30.0), "delta2": (0.0, 3.0),
          "A_data": (-5.0, 40.0), "t_data": (0.0, 30.0), "alpha": (0.0, 3.0)}
HUBER_DELTA = 1e-3


@dataclass(frozen=True)
class DlcmLaw:
    E0: float
    A_tok: float
    t_tok: float
    delta1: float
    A_con: float
    gamma: float
    t_con: float
    delta2: float
    A_data: float
    t_data: float
    alpha: float

    @classmethod
    def from_theta(cls, theta: np.ndarray) -> "DlcmLaw":
        return cls(**{k: float(np.exp(v)) if k in LOGGED else float(v) for k, v in zip(NAMES, theta)})

    def theta(self) -> np.ndarray:
        return np.array([np.log(getattr(self, k)) if k in LOGGED else getattr(self, k) for k in NAMES])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def loss(self, N: np.ndarray, D: np.ndarray, R: np.ndarray, P: np.ndarray) -> np.ndarray:
        N, D, R, P = (np.asarray(x, float) for x in (N, D, R, P))
        return (self.E0 + self.A_tok / (N * (1 - P) + self.t_tok) ** self.delta1
                + self.A_con * R ** self.gamma / (N * P + self.t_con) ** self.delta2
                + self.A_data / (D + self.t_data) ** self.alpha)


def _log_loss(theta: np.ndarray, N: np.ndarray, D: np.ndarray, R: np.ndarray, P: np.ndarray) -> np.ndarray:
    """log L(N, D, R, P) in log-sum-exp form (no overflow for large A)."""
    e0, a_tok, t_tok, d1, a_con, g, t_con, d2, a_dat, t_dat, al = theta
    terms = np.stack([np.full_like(N, e0),
                      a_tok - d1 * np.log(N * (1 - P) + np.exp(t_tok)),
                      a_con + g * np.log(R) - d2 * np.log(N * P + np.exp(t_con)),
                      a_dat - al * np.log(D + np.exp(t_dat))])
    return np.logaddexp.reduce(terms, axis=0)


def fit_dlcm(N: np.ndarray, D: np.ndarray, R: np.ndarray, P: np.ndarray, L: np.ndarray,
             starts: int = 24, seed: int = 0) -> DlcmLaw:
    """The Huber fit of Eq. 22 in log space, L-BFGS-B from ``starts`` starts (a grid of the
    exponents with the scales set from the data, and random draws), the best kept."""
    from scipy.optimize import minimize

    N, D, R, P, L = (np.asarray(x, float) for x in (N, D, R, P, L))
    if len(L) < len(NAMES):
        raise UserError(f"DLCM's Eq. 22 has {len(NAMES)} parameters: its fit needs at least {len(NAMES)} points, "
                        f"got {len(L)}", hint="a grid over N, P, R and D (DLCM: 3 x 3 x 3 and the budget)")
    if not (np.all(N > 0) and np.all(D > 0) and np.all(R > 0) and np.all((P > 0) & (P < 1)) and np.all(L > 0)):
        raise UserError("Eq. 22 needs positive N, D, R and loss and a concept share P strictly between 0 and 1")
    logL = np.log(L)

    def fun(theta: np.ndarray) -> float:
        r = _log_loss(theta, N, D, R, P) - logL
        return float(np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r * r,
                              HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum())

    bounds = [BOUNDS[k] for k in NAMES]
    rng = np.random.default_rng(seed)
    e0 = np.log(0.8 * L.min())
    inits = []
    for d1, d2, al in itertools.product((0.2, 0.4, 0.8), (0.2, 0.4, 0.8), (0.2, 0.4)):
        # each term about a third of the loss above E0 at the data's median N and D
        gap = np.log(max(np.median(L) - np.exp(e0), 1e-3) / 3)
        inits.append([e0, gap + d1 * np.log(np.median(N)), 0.0, d1, gap + d2 * np.log(np.median(N) / 2), 0.3, 0.0,
                      d2, gap + al * np.log(np.median(D)), 0.0, al])
    inits = np.array(inits)[rng.permutation(len(inits))[:starts]]
    best = None
    for x0 in inits:
        res = minimize(fun, x0, method="L-BFGS-B", bounds=bounds, options={"maxiter": 3000, "ftol": 1e-15})
        if best is None or res.fun < best.fun:
            best = res
    return DlcmLaw.from_theta(best.x)


@dataclass(frozen=True)
class DecayLaw:
    """Δ_decay = k L_stable^a R^b N^c."""

    k: float
    a: float
    b: float
    c: float
    r2: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def delta(self, L_stable: np.ndarray, R: np.ndarray, N: np.ndarray) -> np.ndarray:
        return self.k * np.asarray(L_stable, float) ** self.a * np.asarray(R, float) ** self.b \
            * np.asarray(N, float) ** self.c


def fit_decay(L_stable: np.ndarray, L_decayed: np.ndarray, R: np.ndarray, N: np.ndarray) -> DecayLaw:
    """Least squares of log Δ on log L_stable, log R, log N (Δ = L_stable − L_decayed > 0)."""
    L_stable, L_decayed, R, N = (np.asarray(x, float) for x in (L_stable, L_decayed, R, N))
    if len(L_stable) < 4:
        raise UserError(f"the decay-phase law has 4 parameters: its fit needs at least 4 points, got {len(L_stable)}")
    delta = L_stable - L_decayed
    if not np.all(delta > 0):
        raise UserError("the decay-phase law needs every decayed loss below its stable-phase loss "
                        f"({int(np.sum(delta <= 0))} point(s) are not)")
    X = np.column_stack([np.ones_like(delta), np.log(L_stable), np.log(R), np.log(N)])
    y = np.log(delta)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    return DecayLaw(k=float(np.exp(coef[0])), a=float(coef[1]), b=float(coef[2]), c=float(coef[3]),
                    r2=1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 1.0)
