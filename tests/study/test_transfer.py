"""`ncpctl fit --transfer` (DLCM Fig. 3): on synthetic loss curves whose optimal learning rate per
width is known, the transfer view recovers each optimum, says the optimum stays put when it does
and flags the width whose optimum moved; a run directory carries the lr and widths of its resolved
recipe; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncpctl.cli.app import app
from ncpctl.errors import UserError
from ncpctl.study.points import Point
from ncpctl.study.transfer import transfer, transfer_verdict

from ..conftest import RECIPES

LOG2_LRS = np.arange(-13.0, -6.0)  # 2^-13 .. 2^-7: one grid step = 1 in log2


def _points(optima: dict[int, float], lrs: np.ndarray = LOG2_LRS, curvature: float = 0.05) -> list[Point]:
    """Loss = 3 - 0.1 log2(width) + curvature (log2 lr - optimum)^2 at every width x lr."""
    return [Point(family="default", name=f"w{w},lr{x:g}", N=1e6 * w, D=1e9, C=6e15 * w,
                  metrics={"loss": 3.0 - 0.1 * np.log2(w) + curvature * (x - opt) ** 2},
                  settings={"lr": float(2.0 ** x), "width": float(w), "concept_width": 2.0 * w})
            for w, opt in optima.items() for x in lrs]


def test_transfer_recovers_each_optimum_and_flags_a_moved_width() -> None:
    t = transfer(_points({32: -10.3, 64: -10.0, 128: -9.6}))
    assert t["grid_step_log2"] == 1.0 and t["reference_width"] == 32
    assert [r["method"] for r in t["widths"]] == ["parabola"] * 3
    assert [r["opt_log2"] for r in t["widths"]] == pytest.approx([-10.3, -10.0, -9.6], abs=1e-9)
    assert t["widths"][2]["opt_lr"] == pytest.approx(2.0 ** -9.6) and t["widths"][2]["concept_width"] == 256
    assert t["spread_log2"] == pytest.approx(0.7) and t["stays_put"] and t["moved"] == []
    moved = transfer(_points({32: -10.3, 64: -10.0, 128: -8.2}))  # 2.1 grid steps above the proxy's
    assert not moved["stays_put"] and moved["moved"] == [128]
    assert moved["widths"][2]["shift_steps"] == pytest.approx(2.1) and not moved["widths"][1]["moved"]
    assert transfer(_points({32: -10.3, 64: -10.0, 128: -8.2}), tolerance=2.5)["stays_put"]


def test_an_optimum_at_the_edge_or_between_two_rates_is_the_best_rate() -> None:
    t = transfer(_points({32: -10.0, 64: -14.0}))  # 64's optimum below the grid: a bound at 2^-13
    assert [r["method"] for r in t["widths"]] == ["parabola", "argmin-edge"] and t["edge"] == [64]
    assert t["widths"][1]["opt_lr"] == 2.0 ** -13
    two = transfer(_points({32: -10.0, 64: -10.0}, lrs=np.array([-10.0, -9.0])))
    assert [r["method"] for r in two["widths"]] == ["argmin", "argmin"] and two["widths"][0]["opt_lr"] == 2.0 ** -10


def test_an_optimum_at_the_grids_edge_never_stays_put() -> None:
    """Issue 40 item 7d: width 64's best rate is the grid's smallest (its optimum may lie below): within
    the tolerance of width 32's, the verdict is undetermined (null), never "stays put"; two rates put
    every optimum at an edge."""
    t = transfer(_points({32: -12.3, 64: -13.4}))
    assert t["edge"] == [64] and t["spread_steps"] < 1 and t["stays_put"] is None
    assert "cannot be said to stay put" in transfer_verdict(t)
    two = transfer(_points({32: -10.0, 64: -10.0}, lrs=np.array([-10.0, -9.0])))
    assert two["stays_put"] is None and two["edge"] == [32, 64]
    assert transfer(_points({32: -10.3, 64: -10.0}))["stays_put"] is True  # inside the grid: as before


def test_a_diverged_run_is_the_worst_and_stops_no_other_width() -> None:
    pts = [p if not (p.settings["width"] == 64 and p.settings["lr"] > 2.0 ** -9.5) else
           Point(**{**p.__dict__, "metrics": {"loss": float("nan")}}) for p in _points({32: -10.3, 64: -10.0})]
    t = transfer(pts)  # width 64 diverged at 2^-9 and above: its best, 2^-10, has a diverged neighbour
    assert t["widths"][0]["method"] == "parabola" and t["widths"][1]["method"] == "argmin"
    assert t["widths"][1]["opt_lr"] == 2.0 ** -10 and t["stays_put"]


def test_repeated_runs_of_one_setting_are_averaged() -> None:
    pts = _points({32: -10.0, 64: -10.0})
    seed2 = [Point(**{**p.__dict__, "name": p.name + ",s2", "metrics": {"loss": p.metrics["loss"] + 0.02}}) for p in pts]
    t = transfer(pts + seed2)
    assert [r["runs"] for r in t["widths"]] == [14, 14]
    assert t["widths"][0]["opt_value"] == pytest.approx(3.0 - 0.5 + 0.01)


def test_bad_transfer_requests_are_refused() -> None:
    with pytest.raises(UserError, match="width 64 has 1 learning rate"):
        transfer(_points({32: -10.0}) + _points({64: -10.0}, lrs=np.array([-10.0])))
    with pytest.raises(UserError, match="two or more widths, got 1"):
        transfer(_points({32: -10.0}))
    with pytest.raises(UserError, match="setting 'width' for every point"):
        transfer([Point(**{**p.__dict__, "settings": {"lr": p.settings["lr"]}}) for p in _points({32: -10.0})])
    with pytest.raises(UserError, match="one family, got 2"):
        transfer(_points({32: -10.0, 64: -10.0}) + [Point(**{**p.__dict__, "family": "b"}) for p in _points({32: -9.0})])
    with pytest.raises(UserError, match="--lr-column lr_other"):
        transfer(_points({32: -10.0, 64: -10.0}), lr_column="lr_other")


def _table(path: Path, pts: list[Point]) -> Path:
    path.write_text(json.dumps([p.to_dict() for p in pts]))
    return path


def test_fit_transfer_through_the_entry_point(tmp_path: Path) -> None:
    table = _table(tmp_path / "lr.json", _points({32: -10.3, 64: -10.0, 128: -8.2}))
    r = CliRunner().invoke(app, ["fit", str(table), "--transfer", "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["command"] == "fit" and rep["points"] == 21 and "families" not in rep
    t = rep["transfer"]
    assert [w["opt_log2"] for w in t["widths"]] == pytest.approx([-10.3, -10.0, -8.2]) and t["moved"] == [128]
    md = (tmp_path / "out" / "fit.md").read_text()
    assert "muP learning-rate transfer" in md and "| 128/256 | 7 | 0.00391 | 0.0034 | parabola |" in md and "moves across widths" in md
    assert json.loads((tmp_path / "out" / "fit.json").read_text())["input"][0]["width"] == 32
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in md
    else:
        assert (tmp_path / "out" / "fit_transfer.png").stat().st_size > 0
    human = CliRunner().invoke(app, ["fit", str(table), "--transfer", "--no-plots", "--out", str(tmp_path / "o2")])
    assert human.exit_code == 0 and "moves across widths" in human.output and "parabola" in human.output


def test_fit_transfer_with_one_lr_per_width_is_one_line_and_exit_2(tmp_path: Path) -> None:
    table = _table(tmp_path / "lr.json", _points({32: -10.0, 64: -10.0}, lrs=np.array([-10.0])))
    r = CliRunner().invoke(app, ["fit", str(table), "--transfer", "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 2, r.output
    out = json.loads(r.stdout)
    assert out["ok"] is False and len(out["errors"]) == 1 and "width 32 has 1 learning rate" in out["errors"][0]
    assert not (tmp_path / "out").exists()


def test_a_run_directory_carries_its_rates_and_widths(tmp_path: Path) -> None:
    """The settings come from the resolved recipe: train.lr, the muP base rates, d_model, d_concept."""
    from ncpctl.recipe.load import load_recipe
    from ncpctl.study.points import settings

    r = load_recipe(RECIPES / "debug-dlcm.yaml", ["train.mup_lr_token=1e-3", "model.d_model=128"])
    assert settings(r) == {"lr": 3e-3, "lr_token": 1e-3, "lr_concept": 3e-3, "width": 128.0, "concept_width": 128.0}
    assert "concept_width" not in settings(load_recipe(RECIPES / "debug.yaml", ["model.concept.enabled=false"]))


def test_a_transfer_sweep_point_trains_each_group_at_its_rate_over_s() -> None:
    """A debug-mup-transfer point at width 128 (s_token = 128/64, s_concept = 256/64: debug-dlcm's one
    base width 64): the token and concept modules' hidden matrices at the swept base rate / s,
    everything else at the base rate."""
    from ncpctl.model.core.model import NCPModel
    from ncpctl.profile.load import load_for_profile
    from ncpctl.study.sweep import read_sweep
    from ncpctl.train.config import make_optimizer

    sweep, _ = read_sweep(RECIPES / "sweeps" / "debug-mup-transfer.yaml")
    point = next(p for p in sweep.points if p.name == "d128+lr9e-3")
    r, _ = load_for_profile(str(sweep.base), [f"{k}={json.dumps(v)}" for k, v in point.params.items()],
                            drop_missing_sets=True)  # the shared data is tokenized later
    assert r.model_config.mup_widths == (2.0, 4.0)
    lrs = {g["name"]: g["lr"] for g in make_optimizer(NCPModel(r.model_config), r, on_gpu=False).param_groups}
    assert lrs == pytest.approx({"decay": 9e-3, "no_decay": 9e-3, "decay_token": 4.5e-3, "decay_concept": 2.25e-3})
