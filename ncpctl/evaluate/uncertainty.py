"""Comparing runs with their uncertainty (issue 26 item 4): the statistics behind ``ncpctl eval
--compare`` (``compare_curves``: tokens-to-reach and windows; ``compare_arms``: seed arms).

* ``tokens_to_reach``: NCP-ArchPreview Fig. 1's claim, the fraction of the baseline's tokens a run
  needs to reach the baseline's final loss (51.3% in Stage 1): the first crossing of the run's
  curve below that loss, linearly interpolated between the two logged points around it.
* ``window``: a curve's mean over its last N steps, or the whole run (Tables 3 and 8).
* ``seeds``: mean ± sample standard deviation of one score over the seeds of an arm.
* ``paired_bootstrap``: the difference of two models' mean per-example scores on the same
  examples, with a percentile interval from resampling the examples (the pairing keeps the
  example difficulty out of the noise): what a +0.4 point claim needs.
* ``stratified_bootstrap``: the same for a paper aggregate, a weighted sum of task means ("Avg",
  the number behind ConceptLM's +0.1/+0.4): the examples are resampled within each task and the
  aggregate is rebuilt from the resampled task means.

The p-values are approximations: twice the smaller share of resampled differences on either side
of 0 (a percentile-bootstrap p-value, coarse below about 1/resamples and when the examples are few).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ncpctl.errors import UserError


def _curve(xs: Sequence[float], ys: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise UserError(f"{name}: a curve needs two or more (tokens, loss) points of equal length")
    if np.any(np.diff(x) <= 0):
        raise UserError(f"{name}: tokens must increase along the curve")
    return x, y


def tokens_to_reach(base_tokens: Sequence[float], base_loss: Sequence[float],
                    run_tokens: Sequence[float], run_loss: Sequence[float]) -> dict[str, float | None]:
    """The tokens at which the run first reaches the baseline's final loss (linear interpolation),
    and their ratio to the baseline's final tokens; None when the run never gets there."""
    bx, by = _curve(base_tokens, base_loss, "baseline")
    rx, ry = _curve(run_tokens, run_loss, "run")
    target = float(by[-1])
    hit = np.nonzero(ry <= target)[0]
    if len(hit) == 0:
        return {"target_loss": target, "tokens": None, "ratio": None}
    i = int(hit[0])
    if i == 0:
        t = float(rx[0])
    else:  # between (x0, y0) above the target and (x1, y1) at or below it
        x0, x1, y0, y1 = rx[i - 1], rx[i], ry[i - 1], ry[i]
        t = float(x0 + (y0 - target) / (y0 - y1) * (x1 - x0))
    return {"target_loss": target, "tokens": t, "ratio": t / float(bx[-1])}


def window(steps: Sequence[float], values: Sequence[float], last: int | None = None) -> dict[str, float]:
    """Mean of ``values`` over the last ``last`` steps (steps > final step - last), or all of them."""
    s, v = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if len(s) == 0:
        raise UserError("a window aggregate needs at least one logged step")
    keep = s > s[-1] - last if last is not None else np.ones(len(s), dtype=bool)
    return {"mean": float(v[keep].mean()), "points": int(keep.sum()), "last_steps": last}


def seeds(values: Sequence[float]) -> dict[str, float]:
    """Mean ± sample standard deviation (ddof 1) over seeds."""
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else math.nan, "n": len(v)}


def paired_bootstrap(a: Sequence[float], b: Sequence[float], iters: int = 2000, level: float = 0.95,
                     seed: int = 0) -> dict[str, float]:
    """mean(b - a) over the same examples, with the percentile interval of the bootstrap over
    examples (``iters`` resamples) and the two-sided bootstrap p-value of "no difference"."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise UserError(f"a paired comparison needs the same examples in both runs (got {len(x)} and {len(y)})")
    d = y - x
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(iters, len(d)))].mean(axis=1)  # (iters,)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    p = min(1.0, 2 * min(float((means <= 0).mean()), float((means >= 0).mean())))
    return {"diff": float(d.mean()), "low": float(lo), "high": float(hi), "level": level, "p": p, "n": len(d)}


def stratified_bootstrap(strata: Sequence[tuple[Sequence[float], Sequence[float], float]], iters: int = 2000,
                         level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """sum over strata of w x mean(b - a) (``strata``: (a, b, w), a and b one stratum's paired
    per-example scores), with the percentile interval from resampling the examples within each stratum
    independently and the approximate two-sided bootstrap p-value of "no difference"."""
    rng = np.random.default_rng(seed)
    total = np.zeros(iters)  # (iters,) resampled aggregate differences
    diff, n = 0.0, 0
    for a, b, w in strata:
        x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        if x.shape != y.shape or x.ndim != 1 or len(x) < 1:
            raise UserError(f"a paired comparison needs the same examples in both runs (got {len(x)} and {len(y)})")
        d = y - x
        diff, n = diff + w * float(d.mean()), n + len(d)
        step = max(1, (1 << 22) // len(d))  # at most ~4M indices at a time: (step, len(d))
        for s in range(0, iters, step):
            k = min(step, iters - s)
            total[s : s + k] += w * d[rng.integers(0, len(d), size=(k, len(d)))].mean(axis=1)
    if n < 2:
        raise UserError("a paired comparison needs at least two examples")
    lo, hi = np.quantile(total, [(1 - level) / 2, (1 + level) / 2])
    p = min(1.0, 2 * min(float((total <= 0).mean()), float((total >= 0).mean())))
    return {"diff": diff, "low": float(lo), "high": float(hi), "level": level, "p": p, "n": n, "strata": len(strata)}
