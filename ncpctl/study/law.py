"""The parametric scaling law L(N, D) = E + A / N^α + B / D^β (Hoffmann et al. 2022, approach 3).

The fit follows Hoffmann et al. and the replication by Besiroglu et al. (2024): the law in
log-sum-exp form, log L̂ = LSE(a − α log N, b − β log D, e) with A = e^a, B = e^b, E = e^e; a
Huber loss (δ = 1e-3) on the residuals log L̂ − log L; L-BFGS-B from the best starting points
of a grid. Besiroglu et al. show that a single start or a squared loss moves the exponents: the
surface has shallow valleys, and a few outlying runs dominate a squared loss.

The grid (6,480 points) is scored in one vectorised pass and L-BFGS runs from its ``starts``
best points. Bootstrap refits (``bootstrap_laws``) resample the points with replacement (as
counts: weights of the Huber loss) and refit every resample from the grid, as Besiroglu et al.
do: each resample's own ``starts`` best grid points (the grid scored once, then weighted by each
resample's counts) and the full fit, all refitted at once by batched Levenberg-Marquardt steps on
the reweighted least squares that majorise the Huber loss (``_lm``); a refit still walking a flat
valley after BOOT_ITERS steps is finished by L-BFGS; the best optimum of each resample is kept.
A refit started from the full fit alone stays near it: on the tiny study L-BFGS from each
resample's grid starts finds a better optimum (by over 1e-6 of the loss) in 23/200 (base) and
12/200 (ConceptLM) resamples, and base E's interval is [0.00, 4.12], not [0.92, 4.12]; these
refits miss none of them (tests/study/test_fit.py checks them against L-BFGS from the same grid).

The compute-optimal frontier of a fitted law, at C = f · N · D FLOPs (f: the family's FLOPs per
parameter and token, 6 for a plain transformer counted as 6ND), is closed-form:
N_opt = G (C/f)^(β/(α+β)), D_opt = (C/f)^(α/(α+β)) / G, G = (αA / βB)^(1/(α+β)), and
L*(C) = E + K (C/f)^(−αβ/(α+β)) with K = A G^(−α) + B G^β.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from ncpctl.errors import UserError

N_PARAMS = 5
MIN_POINTS = 2 * N_PARAMS  # fewer: refused (the fit interpolates its points)
FIRM_POINTS = 3 * N_PARAMS  # fewer: fitted with a caution (the tiny study has 15 per family)
EXPONENT_BOUNDS = (0.0, 5.0)  # L-BFGS-B's bounds on α and β
HUBER_DELTA = 1e-3
# the starting grid of (e, a, b, α, β), as in Hoffmann et al.'s approach 3 (a coarser α, β)
GRID_SCALE = 3.0  # the geometric-mean loss the grid is searched at (fit_law)
GRID = {"e": (-1.0, -0.5, 0.0, 0.5, 1.0), "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
        "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "alpha": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0),
        "beta": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)}


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^α + B / D^β."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    @classmethod
    def from_theta(cls, theta: np.ndarray) -> "Law":
        e, a, b, al, be = (float(v) for v in theta)
        return cls(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=al, beta=be)

    def theta(self) -> np.ndarray:
        return np.array([np.log(self.E), np.log(self.A), np.log(self.B), self.alpha, self.beta])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def loss(self, N: np.ndarray, D: np.ndarray) -> np.ndarray:
        return self.E + self.A / np.asarray(N, float) ** self.alpha + self.B / np.asarray(D, float) ** self.beta

    def _g(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimal(self, C: np.ndarray | float, f: float) -> tuple[np.ndarray, np.ndarray]:
        """(N_opt, D_opt) at C = f · N · D FLOPs."""
        x = np.asarray(C, float) / f
        s = self.alpha + self.beta
        g = self._g()
        return g * x ** (self.beta / s), x ** (self.alpha / s) / g

    def frontier(self, C: np.ndarray | float, f: float) -> np.ndarray:
        """The lowest loss reachable with C FLOPs, L*(C)."""
        n, d = self.optimal(C, f)
        return self.loss(n, d)

    def compute_for(self, loss: float, f: float) -> float:
        """The C with L*(C) = loss (inf when loss <= E: never reached)."""
        if not loss > self.E or self.alpha <= 0 or self.beta <= 0:
            return float("inf")
        g, s = self._g(), self.alpha + self.beta
        k = self.A * g ** (-self.alpha) + self.B * g ** self.beta
        return float(f * ((loss - self.E) / k) ** (-s / (self.alpha * self.beta)))


def _objective(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray,
               w: np.ndarray, delta: float) -> tuple[float, np.ndarray]:
    """Weighted Huber loss of the log residuals and its gradient, for K parameter rows at once.

    theta: (K, 5); logN, logD, logL: (n,); w: (K, n) weights (bootstrap counts; ones for a plain
    fit). Returns the summed loss over the K rows and its gradient (K, 5)."""
    e, a, b, al, be = (theta[:, i:i + 1] for i in range(5))  # each (K, 1)
    terms = np.stack([a - al * logN, b - be * logD, np.broadcast_to(e, (len(theta), len(logN)))])  # (3, K, n)
    top = terms.max(axis=0)
    ex = np.exp(terms - top)
    tot = ex.sum(axis=0)
    r = top + np.log(tot) - logL  # (K, n)
    soft = ex / tot  # d LSE / d term, (3, K, n)
    quad = np.abs(r) <= delta
    h = np.where(quad, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    dh = w * np.where(quad, r, delta * np.sign(r))  # (K, n)
    grad = np.stack([(dh * soft[2]).sum(1), (dh * soft[0]).sum(1), (dh * soft[1]).sum(1),
                     -(dh * soft[0] * logN).sum(1), -(dh * soft[1] * logD).sum(1)], axis=1)
    return float((w * h).sum()), grad


def _lbfgs(theta0: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, w: np.ndarray,
           delta: float) -> np.ndarray:
    """L-BFGS-B from each row of theta0 (K, 5) on its own, exponents kept in [0, 5]. Returns (K, 5)."""
    from scipy.optimize import minimize

    bounds = [(None, None)] * 3 + [EXPONENT_BOUNDS] * 2
    out = np.empty_like(theta0)
    for k, t0 in enumerate(theta0):
        def fun(x: np.ndarray, k: int = k) -> tuple[float, np.ndarray]:
            v, g = _objective(x[None], logN, logD, logL, w[k:k + 1], delta)
            return v, g[0]

        out[k] = minimize(fun, t0, jac=True, method="L-BFGS-B", bounds=bounds,
                          options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12}).x
    return out


RTOL = 1e-12  # an accepted LM step that lowers a row's loss by less (relative) ends that row
POLISH_WITHIN = 1e-3  # ... those within this (relative) of their resample's best loss: the others cannot win
BOOT_ITERS = 1000  # LM steps of the bootstrap's refits; rows still walking then (a flat valley) finish by L-BFGS,


def _parts(th: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, w: np.ndarray,
           delta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For K parameter rows th (K, 5) and weights w (K, n): the log residuals r (K, n), their Jacobian
    J (K, n, 5) and each row's weighted Huber loss h (K,)."""
    e, a, b, al, be = (th[:, i:i + 1] for i in range(5))
    terms = np.stack([a - al * logN, b - be * logD, np.broadcast_to(e, (len(th), len(logN)))])
    top = terms.max(axis=0)
    ex = np.exp(terms - top)
    r = top + np.log(ex.sum(axis=0)) - logL
    soft = ex / ex.sum(axis=0)
    J = np.stack([soft[2], soft[0], soft[1], -soft[0] * logN, -soft[1] * logD], axis=2)  # (K, n, 5)
    h = (w * np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))).sum(1)
    return r, J, h


def _batched_refit(theta0: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, w: np.ndarray,
                   delta: float, iters: int = 200) -> np.ndarray:
    """Minimise the K weighted Huber objectives at once (the bootstrap's refits): ``_lm``'s optima."""
    return _lm(theta0, logN, logD, logL, w, delta, iters)[0]


def _lm(theta0: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, w: np.ndarray,
        delta: float, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt steps on the iteratively reweighted least squares that majorises the Huber
    loss (weight min(1, δ/|r|) per residual), for K rows at once, a step kept only where it lowers that
    row's Huber loss. A row is done when no step lowers its loss (its damping past 1e8) or an accepted
    step no longer moves it (by RTOL), and is left out of later steps. Returns the rows (K, 5) and
    which are done (K,): the others were still walking (a flat valley) when ``iters`` ran out."""
    with np.errstate(over="ignore", invalid="ignore"):  # a wild trial step: an infinite loss, rejected
        return _lm_steps(theta0.copy(), logN, logD, logL, w, delta, iters)


def _lm_steps(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, w: np.ndarray,
              delta: float, iters: int) -> tuple[np.ndarray, np.ndarray]:
    lam = np.full(len(theta), 1e-3)
    r, J, h = _parts(theta, logN, logD, logL, w, delta)
    eye = np.eye(N_PARAMS)
    for _ in range(iters):
        act = np.flatnonzero(lam <= 1e8)  # the rows still moving
        if not len(act):
            break
        ra, Ja, wa, la = r[act], J[act], w[act], lam[act]
        om = wa * np.minimum(1.0, delta / np.maximum(np.abs(ra), 1e-300))  # (K', n)
        JtW = (Ja * om[..., None]).transpose(0, 2, 1)  # (K', 5, n)
        JtJ = JtW @ Ja  # (K', 5, 5)
        g = (JtW @ ra[..., None])[..., 0]  # (K', 5)
        damp = JtJ + la[:, None, None] * (eye * np.diagonal(JtJ, axis1=1, axis2=2)[:, None, :] + 1e-12 * eye)
        try:
            step = np.linalg.solve(damp, -g[..., None])[..., 0]
        except np.linalg.LinAlgError:  # a resample that pins no direction (e.g. one size only)
            step = -np.einsum("kij,kj->ki", np.linalg.pinv(damp), g)
        trial = theta[act] + step
        trial[:, 3:] = np.clip(trial[:, 3:], *EXPONENT_BOUNDS)
        r2, J2, h2 = _parts(trial, logN, logD, logL, wa, delta)
        ok = h2 < h[act]
        keep = act[ok]
        tiny = ok & (h[act] - h2 <= RTOL * h[act])  # an accepted step that no longer moves the loss: converged
        theta[keep], r[keep], J[keep], h[keep] = trial[ok], r2[ok], J2[ok], h2[ok]
        lam[act] = np.where(tiny, np.inf, np.where(ok, la / 3.0, la * 4.0))
    return theta, lam > 1e8


def _check(N: np.ndarray, D: np.ndarray, L: np.ndarray) -> None:
    if len(L) < MIN_POINTS:
        raise UserError(f"the law L = E + A/N^α + B/D^β has {N_PARAMS} parameters: a fit needs at least "
                        f"{MIN_POINTS} points (twice its parameters), got {len(L)}",
                        hint="add runs (a 5 x 5 grid of N and D is a good start)")
    if not (np.all(N > 0) and np.all(D > 0) and np.all(L > 0) and np.all(np.isfinite(L))):
        raise UserError("the law needs positive, finite N, D and loss for every point")


def fit_law(N: np.ndarray, D: np.ndarray, L: np.ndarray, starts: int = 8, delta: float = HUBER_DELTA) -> Law:
    """The Huber fit of L = E + A/N^α + B/D^β in log space: the grid scored at once, L-BFGS from
    its ``starts`` best points, the best optimum kept."""
    N, D, L = (np.asarray(x, float) for x in (N, D, L))
    _check(N, D, L)
    # The grid is Hoffmann et al.'s, for losses of a few nats: a metric on another scale (1 − AUC) is
    # searched at a geometric mean of GRID_SCALE, and E, A, B scaled back (the log-space Huber loss
    # does not change under the scaling: ln E, ln A, ln B and ln L all shift by the same amount).
    shift = float(np.mean(np.log(L))) - np.log(GRID_SCALE)
    logN, logD, logL = np.log(N), np.log(D), np.log(L) - shift
    grid = np.array(list(itertools.product(*GRID.values())))  # (G, 5) in (e, a, b, α, β) order
    scores = _grid_scores(grid, logN, logD, logL, delta)
    best = grid[np.argsort(scores)[:starts]]
    opt = _lbfgs(best, logN, logD, logL, np.ones((len(best), len(L))), delta)
    vals = np.array([_objective(o[None], logN, logD, logL, np.ones((1, len(L))), delta)[0] for o in opt])
    theta = opt[int(np.argmin(vals))]
    theta[:3] += shift  # ln E, ln A, ln B back at the metric's scale
    return Law.from_theta(theta)


def _grid_huber(grid: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, delta: float) -> np.ndarray:
    """The Huber loss of every point at every grid point, (G, n), in chunks to bound memory."""
    out = []
    for i in range(0, len(grid), 2048):
        g = grid[i:i + 2048]
        e, a, b, al, be = (g[:, j:j + 1] for j in range(5))
        terms = np.stack([a - al * logN, b - be * logD, np.broadcast_to(e, (len(g), len(logN)))])
        r = np.logaddexp.reduce(terms, axis=0) - logL
        out.append(np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)))
    return np.concatenate(out)


def _grid_scores(grid: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, delta: float) -> np.ndarray:
    """The objective at every grid point (G,)."""
    return _grid_huber(grid, logN, logD, logL, delta).sum(axis=1)


def bootstrap_laws(N: np.ndarray, D: np.ndarray, L: np.ndarray, law: Law, resamples: int,
                   rng: np.random.Generator, delta: float = HUBER_DELTA, starts: int = 8) -> list[Law]:
    """``resamples`` refits on the points drawn with replacement (as counts: weights of the Huber
    loss), each from its own ``starts`` best grid points and from ``law`` (the full fit), the best
    optimum of each kept; all refits run at once."""
    N, D, L = (np.asarray(x, float) for x in (N, D, L))
    n = len(L)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(float)  # (B, n) counts
    shift = float(np.mean(np.log(L))) - np.log(GRID_SCALE)  # the grid's scale, as fit_law
    logN, logD, logL = np.log(N), np.log(D), np.log(L) - shift
    grid = np.array(list(itertools.product(*GRID.values())))  # (G, 5)
    scores = _grid_huber(grid, logN, logD, logL, delta) @ w.T  # (G, B): each resample's grid objective
    best = np.argpartition(scores, starts, axis=0)[:starts].T if starts < len(grid) else np.argsort(scores, axis=0).T
    best = best[:, :starts]  # (B, starts): each resample's best grid points (in no order)
    full = law.theta()
    full[:3] -= shift
    theta0 = np.concatenate([full[None, None].repeat(resamples, 0), grid[best]], axis=1)  # (B, starts + 1, 5)
    k = theta0.shape[1]
    wk = np.repeat(w, k, axis=0)  # (B (starts + 1), n)
    opt, done = _lm(theta0.reshape(-1, N_PARAMS), logN, logD, logL, wk, delta, BOOT_ITERS)
    h = _parts(opt, logN, logD, logL, wk, delta)[2].reshape(resamples, k)
    near = (h <= h.min(axis=1, keepdims=True) * (1 + POLISH_WITHIN)).ravel()
    walking = np.flatnonzero(~done & near)  # still in a flat valley, and in the running: L-BFGS finishes it
    for i in walking:
        opt[i] = _lbfgs(opt[i][None], logN, logD, logL, wk[i][None], delta)[0]
    h = _parts(opt, logN, logD, logL, wk, delta)[2].reshape(resamples, k)  # (B, starts + 1)
    pick = opt[np.arange(resamples) * k + h.argmin(axis=1)]  # each resample's best refit
    pick[:, :3] += shift
    return [Law.from_theta(t) for t in pick]
