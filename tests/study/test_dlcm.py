"""DLCM's Eq. 22 and its decay-phase law (ncpctl.study.dlcm) on synthetic data from known laws."""

from __future__ import annotations

import numpy as np
import pytest

from ncpctl.errors import UserError
from ncpctl.study.dlcm import DlcmLaw, fit_decay, fit_dlcm
from ncpctl.study.fit import FitOptions, analyse
from ncpctl.study.points import Point

TRUE = DlcmLaw(E0=1.6, A_tok=300.0, t_tok=1e6, delta1=0.32, A_con=150.0, gamma=0.25, t_con=1e6, delta2=0.30,
               A_data=400.0, t_data=1e8, alpha=0.28)


def _grid(rng: np.random.Generator, noise: float = 0.005) -> tuple[np.ndarray, ...]:
    """DLCM's grid: P in {0.3, 0.5, 0.7}, R in {2, 4, 8}, sizes 274M-833M (and a smaller one), three budgets."""
    N, D, R, P = np.array(np.meshgrid([1e8, 2.74e8, 4.68e8, 8.33e8], [2e9, 1e10, 5e10], [2.0, 4.0, 8.0],
                                      [0.3, 0.5, 0.7])).reshape(4, -1)
    return N, D, R, P, TRUE.loss(N, D, R, P) + rng.normal(0.0, noise, N.shape)


def test_eq22_fit_recovers_the_exponents_and_extrapolates() -> None:
    N, D, R, P, L = _grid(np.random.default_rng(0))
    law = fit_dlcm(N, D, R, P, L, starts=4)
    for k in ("delta1", "delta2", "gamma", "alpha"):
        assert abs(getattr(law, k) - getattr(TRUE, k)) < 0.05, (k, law)
    # a model 3.6x the largest size on 4x the largest budget: within 0.02 nats at every R and P
    for r, p in ((2.0, 0.3), (4.0, 0.5), (8.0, 0.7)):
        assert abs(float(law.loss(3e9, 2e11, r, p) - TRUE.loss(3e9, 2e11, r, p))) < 0.02


def test_decay_law_recovers_its_exponents() -> None:
    rng = np.random.default_rng(1)
    L_stable = rng.uniform(2.5, 3.5, 40)
    R = rng.choice([2.0, 4.0, 8.0], 40)
    N = rng.choice([2.74e8, 4.68e8, 8.33e8], 40)
    delta = 0.02 * L_stable ** 1.5 * R ** 0.2 * N ** -0.05 * np.exp(rng.normal(0, 0.01, 40))
    law = fit_decay(L_stable, L_stable - delta, R, N)
    assert (law.a, law.b, law.c) == pytest.approx((1.5, 0.2, -0.05), abs=0.05)
    assert law.r2 > 0.9
    with pytest.raises(UserError, match="decayed loss below its stable-phase loss"):
        fit_decay(L_stable, L_stable + 0.01, R, N)
    with pytest.raises(UserError, match="needs at least 4 points, got 3"):
        fit_decay(L_stable[:3], L_stable[:3] - 0.1, R[:3], N[:3])


def test_analyse_with_dlcm_needs_r_and_p_and_counts_its_parameters() -> None:
    N, D, R, P, L = _grid(np.random.default_rng(2))
    pts = [Point("dlcm", N=a, D=b, C=6 * a * b, metrics={"loss": y}) for a, b, y in zip(N, D, L)]
    with pytest.raises(UserError, match="--dlcm needs the column 'R'"):
        analyse(pts, FitOptions(resamples=0, dlcm=True))
    few = [Point("dlcm", N=a, D=b, C=6 * a * b, metrics={"loss": y, "R": r, "P": p})
           for a, b, y, r, p in list(zip(N, D, L, R, P))[:10]]
    with pytest.raises(UserError, match="11 parameters: its fit needs at least 11 points, got 10"):
        analyse(few, FitOptions(resamples=0, dlcm=True))


def test_eq22_reads_run_directory_columns_at_the_nonembedding_n() -> None:
    """Issue 40 item 7b: a run directory's R and P (settings, not metrics) feed --dlcm, and Eq. 22 is fitted
    at the non-embedding N its P is a share of."""
    N, D, R, P, L = _grid(np.random.default_rng(3))
    pts = [Point("dlcm", N=a + 5e7, D=b, C=6 * a * b, metrics={"loss": y},
                 settings={"R": r, "P": p, "N_nonembedding": a, "C_nonembedding": 6 * a * b})
           for a, b, y, r, p in list(zip(N, D, L, R, P))[::4]]
    rep = analyse(pts, FitOptions(resamples=0, dlcm=True, starts=2))["families"]["dlcm"]["dlcm"]
    assert rep["N"] == "non-embedding" and rep["rmse"] < 0.05
