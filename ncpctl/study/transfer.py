"""The muP learning-rate transfer view of ``ncpctl fit --transfer`` (DLCM Sec. 6.1.2, Fig. 3).

The points are runs of one recipe at several widths x several base learning rates (the sweep
``recipes/sweeps/dlcm-mup-transfer.yaml``); each carries the settings ``width`` and an lr column
(``lr`` by default: train.lr, the rate the sweep varies; ``lr_token`` / ``lr_concept`` name the
modules' base rates). Per width, the metric against x = log2 lr:

* the optimum: with 3 or more rates and the best one inside the grid, the vertex of the parabola
  through the best point and its two neighbours (``method: parabola``; it lies between them);
  otherwise the best rate itself (``argmin``, or ``argmin-edge`` when the best is the grid's
  smallest or largest rate: the true optimum may lie beyond it, so it is a bound);
* its shift from the reference width's optimum (the smallest width: the proxy the rates were tuned
  on, as DLCM's 87M), in log2 and in grid steps (the median spacing of the rates in log2).

The optimum *stays put* when the spread of the optimal log2 lr over the widths (max - min) is within
``tolerance`` grid steps (default one); a width whose optimum is more than that from the
reference's is flagged as moved. When a width's best rate is the smallest or largest of its grid
(the optimum may lie beyond it: a bound, not a position) and the spread is within the tolerance,
the verdict is undetermined (``stays_put: null``), never "stays put". Repeated (width, lr) points (seeds) are averaged; a diverged run
(a loss that is not finite) counts as worse than any other. One family at a time.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ncpctl.errors import UserError
from ncpctl.study.fit import values
from ncpctl.study.points import SETTINGS, Point

LR_COLUMNS = tuple(c for c in SETTINGS if c.startswith("lr"))


def _setting(points: Sequence[Point], col: str) -> np.ndarray:
    missing = [p.name for p in points if col not in p.settings]
    if missing:
        raise UserError(f"--transfer needs the setting {col!r} for every point ({missing[0]} has none)",
                        hint="run directories carry it; a table needs the columns lr (or lr_token, lr_concept) "
                             "and width")
    return np.array([p.settings[col] for p in points], float)


def optimum(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """The optimum of y over x (sorted, distinct; log2 lr): the vertex of the parabola through the
    best point and its neighbours when the best is inside the grid, else the best point."""
    i = int(np.argmin(y))
    if len(x) < 3 or i in (0, len(x) - 1):
        return {"method": "argmin" if len(x) < 3 else "argmin-edge",
                "x": float(x[i]), "value": float(y[i]), "coef": None}
    xs, ys = x[i - 1:i + 2], y[i - 1:i + 2]
    if not np.all(np.isfinite(ys)):  # a diverged neighbour (inf): no parabola, the best point stands
        return {"method": "argmin", "x": float(x[i]), "value": float(y[i]), "coef": None}
    a, b, c = np.polyfit(xs, ys, 2)
    if not a > 0:  # a tie with a neighbour makes a flat or downward parabola: the best point stands
        return {"method": "argmin", "x": float(x[i]), "value": float(y[i]), "coef": None}
    xo = float(-b / (2 * a))
    return {"method": "parabola", "x": xo, "value": float(np.polyval([a, b, c], xo)),
            "coef": [float(a), float(b), float(c)]}


def _grid_step(xs: list[np.ndarray]) -> float:
    """The median spacing of the rates in log2, over every width's grid."""
    gaps = np.concatenate([np.diff(x) for x in xs])
    return float(np.median(gaps))


def transfer(points: Sequence[Point], metric: str = "loss", lr_column: str = "lr",
             tolerance: float = 1.0) -> dict[str, Any]:
    """The transfer view (see the module docstring) as one JSON-able dict."""
    if lr_column not in LR_COLUMNS:
        raise UserError(f"--lr-column {lr_column}: not an lr setting; choose from {', '.join(LR_COLUMNS)}")
    if not tolerance > 0:
        raise UserError(f"--tolerance must be positive (grid steps), got {tolerance:g}")
    fams = sorted({p.family for p in points})
    if len(fams) > 1:
        raise UserError(f"--transfer reads one family, got {len(fams)} ({', '.join(fams)})",
                        hint="fit each family's runs on their own")
    y = values(points, metric)
    y = np.where(np.isfinite(y), y, np.inf)  # a diverged run (nan or inf loss) is worse than any other
    lr, width = _setting(points, lr_column), _setting(points, "width")
    if np.any(lr <= 0):
        raise UserError(f"--transfer: the {lr_column} of every point must be positive")
    concept = {p.settings["width"]: p.settings.get("concept_width") for p in points}
    rows = []
    for w in sorted(set(width.tolist())):
        at = width == w
        rates = sorted(set(lr[at].tolist()))
        if len(rates) < 2:
            raise UserError(f"--transfer: width {w:g} has {len(rates)} learning rate ({rates[0]:g}); the optimum "
                            "per width needs two or more", hint="sweep the base learning rate at every width")
        x = np.log2(rates)
        v = np.array([y[at & (lr == r)].mean() for r in rates])  # seeds of one (width, lr) averaged
        if not np.isfinite(v).any():
            raise UserError(f"--transfer: every run of width {w:g} diverged (its {metric} is not finite)")
        rows.append({"width": w, "concept_width": concept.get(w), "lrs": rates, "values": v.tolist(),
                     "runs": int(at.sum()), **_row_optimum(x, v)})
    if len(rows) < 2:
        raise UserError(f"--transfer needs two or more widths, got {len(rows)} (width {rows[0]['width']:g})",
                        hint="sweep the width too (model.d_model, zipped with its heads and d_concept)")
    step = _grid_step([np.log2(r["lrs"]) for r in rows])
    ref = rows[0]
    for r in rows:
        r["shift_log2"] = r["opt_log2"] - ref["opt_log2"]
        r["shift_steps"] = r["shift_log2"] / step
        r["moved"] = bool(abs(r["shift_steps"]) > tolerance + 1e-9)  # exactly the tolerance is not a move
    opts = [r["opt_log2"] for r in rows]
    spread = float(max(opts) - min(opts))
    edge = [r["width"] for r in rows if r["at_edge"]]
    within = bool(spread <= (tolerance + 1e-9) * step)
    return {"metric": metric, "lr_column": lr_column, "reference_width": ref["width"], "grid_step_log2": step,
            "tolerance_steps": tolerance, "tolerance_log2": tolerance * step, "spread_log2": spread,
            "spread_steps": spread / step, "stays_put": None if within and edge else within,
            "moved": [r["width"] for r in rows if r["moved"]], "edge": edge, "widths": rows}


def _row_optimum(x: np.ndarray, v: np.ndarray) -> dict[str, Any]:
    o, best = optimum(x, v), int(np.argmin(v))
    return {"method": o["method"], "opt_log2": o["x"], "opt_lr": float(2.0 ** o["x"]), "opt_value": o["value"],
            "best_lr": float(2.0 ** x[best]), "coef": o["coef"], "at_edge": best in (0, len(x) - 1)}


def analyse_transfer(points: list[Point], metric: str, lr_column: str, tolerance: float) -> dict[str, Any]:
    """``ncpctl fit --transfer``'s report: the transfer view in place of the scaling analyses
    (an lr sweep's off-optimum runs are not points of a scaling law)."""
    return {"metric": metric, "points": len(points),
            "transfer": transfer(points, metric, lr_column, tolerance)}


def transfer_verdict(t: dict[str, Any]) -> str:
    """One line: does the optimum stay put, and which widths moved or sit at the grid's edge."""
    verdict = {True: "stays put", False: "moves", None: "cannot be said to stay put"}[t["stays_put"]]
    head = (f"optimal {t['lr_column']} {verdict} across widths: spread "
            f"{t['spread_log2']:.2f} in log2 lr ({t['spread_steps']:.2f} grid steps of {t['grid_step_log2']:.3g}), "
            f"tolerance {t['tolerance_steps']:g} grid step(s)")
    if t["moved"]:
        head += "; moved from the reference width " + f"{t['reference_width']:g}: " + ", ".join(
            f"{w:g}" for w in t["moved"])
    if t["edge"]:
        head += "; optimum at the grid's edge (a bound, widen the grid): width " + ", ".join(f"{w:g}" for w in t["edge"])
    return head


TRANSFER_COLUMNS = ["width", "runs", "best lr", "optimum lr", "method", "METRIC", "shift", "moved"]  # METRIC: at the optimum


def transfer_rows(t: dict[str, Any]) -> list[list[str]]:
    """One row per width (token / concept width): the best rate of the grid, the optimum, how it was
    found, the metric there, its shift from the reference width in grid steps, moved or not."""
    out = []
    for r in t["widths"]:
        w = f"{r['width']:g}" + (f"/{r['concept_width']:g}" if r.get("concept_width") else "")
        out.append([w, str(r["runs"]), f"{r['best_lr']:.3g}", f"{r['opt_lr']:.3g}", r["method"],
                    f"{r['opt_value']:.4g}", f"{r['shift_steps']:+.2f}", "yes" if r["moved"] else "no"])
    return out
