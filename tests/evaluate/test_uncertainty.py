"""Run comparisons with uncertainty (ncpctl.evaluate.uncertainty): tokens-to-reach on analytic curves,
window aggregates, and the paired bootstrap's coverage."""

from __future__ import annotations

import numpy as np
import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate.uncertainty import paired_bootstrap, seeds, tokens_to_reach, window


def test_tokens_to_reach_on_analytic_curves() -> None:
    # baseline L(t) = 2 + 10/t over t in [1, 100]: final 2.1. Run L(t) = 2 + 5/t reaches 2.1 at t = 50
    t = np.linspace(1, 100, 397)  # step 0.25: t = 50 is a logged point
    r = tokens_to_reach(t, 2 + 10 / t, t, 2 + 5 / t)
    assert r["target_loss"] == pytest.approx(2.1) and r["tokens"] == pytest.approx(50.0) and r["ratio"] == pytest.approx(0.5)
    # a linear run curve 3 - t/50 crosses 2.1 at t = 45, between logged points 40 and 50: interpolation is exact
    tr = np.array([0.0, 10, 20, 30, 40, 50, 60])
    r = tokens_to_reach(t, 2 + 10 / t, tr, 3 - tr / 50)
    assert r["tokens"] == pytest.approx(45.0) and r["ratio"] == pytest.approx(0.45)
    assert tokens_to_reach(t, 2 + 10 / t, t, 3 + 0 * t)["ratio"] is None  # never reaches it
    with pytest.raises(UserError):
        tokens_to_reach([1, 1], [2, 2], t, t)


def test_window_and_seed_aggregates() -> None:
    steps, vals = list(range(1, 1001)), [float(s) for s in range(1, 1001)]
    assert window(steps, vals, last=200) == {"mean": pytest.approx(900.5), "points": 200, "last_steps": 200}
    assert window(steps, vals)["mean"] == pytest.approx(500.5)
    s = seeds([0.40, 0.42, 0.44])
    assert (s["mean"], s["std"], s["n"]) == (pytest.approx(0.42), pytest.approx(0.02), 3)


def test_paired_bootstrap_covers_the_true_difference_at_its_nominal_rate() -> None:
    rng = np.random.default_rng(1)
    true, draws, hits = 0.004, 200, 0
    for k in range(draws):  # per-example difficulty shared by both models; a +0.4 point true effect
        base = rng.normal(0.5, 0.2, size=400)
        a, b = base + rng.normal(0, 0.05, 400), base + true + rng.normal(0, 0.05, 400)
        r = paired_bootstrap(a, b, iters=400, seed=k)
        hits += r["low"] <= true <= r["high"]
    assert 0.90 <= hits / draws <= 0.99  # nominal 95% (binomial sd over 200 draws ~1.5 points)
    big = paired_bootstrap(np.zeros(300), np.full(300, 0.1) + rng.normal(0, 0.05, 300), iters=400)
    assert big["low"] > 0 and big["p"] < 0.01
    with pytest.raises(UserError):
        paired_bootstrap([0.1, 0.2], [0.1, 0.2, 0.3])
