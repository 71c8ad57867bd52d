"""bench/run_all.py's budget handling (with stand-in scripts; the real benchmarks are not tests):
a script the budget stops keeps the ratios it reported, the ones it did not reach are named,
and the scripts after it still get their time."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from .conftest import REPO


@pytest.fixture
def run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", REPO / "bench" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script(path: Path, plan: dict, ratios: dict, sleep: float = 0.0) -> None:
    path.write_text(textwrap.dedent(f"""\
        import json, sys, time
        if "--help" in sys.argv:
            print("usage: [--json]")
            sys.exit(0)
        print("bench-plan: " + json.dumps({plan!r}), file=sys.stderr, flush=True)
        for name, v in {ratios!r}.items():
            print("bench-ratio: " + json.dumps({{name: v}}), file=sys.stderr, flush=True)
        time.sleep({sleep})
        print(json.dumps({{"ratios": {ratios!r}}}))
        """))


def test_a_stopped_script_reports_what_it_measured_and_what_it_did_not(run_all, tmp_path, monkeypatch, capsys):
    _script(tmp_path / "fast.py", {"a": ">= 1"}, {"a": {"value": 2.0, "goal": ">= 1", "met": True}})
    _script(tmp_path / "slow.py", {"x": ">= 1", "y": "<= 2"}, {"x": {"value": 1.5, "goal": ">= 1", "met": True}},
            sleep=60)
    _script(tmp_path / "after.py", {"z": ">= 1"}, {"z": {"value": 3.0, "goal": ">= 1", "met": True}})
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "MIN_START_S", 0.5)
    monkeypatch.setattr(run_all, "BENCHES", {"fast": ("fast.py", [], 1, ""), "slow": ("slow.py", [], 2, ""),
                                             "after": ("after.py", [], 2, "")})
    out = tmp_path / "results"
    # slow may use the budget left minus after's expected 2 s (at least its own 2 s): stopped at ~2 s
    assert run_all.main(["--budget", "4.5", "--out", str(out)]) == 1
    md = (out / "summary.md").read_text()
    assert "| fast | a | 2.0 | >= 1 | MET |" in md
    assert "| slow | x | 1.5 | >= 1 | MET |" in md  # measured before the budget ran out: kept
    assert any(line.startswith("| slow | y | not measured: stopped after") and line.endswith("| <= 2 | OUT OF TIME |")
               for line in md.splitlines()), md
    assert "| after | z | 3.0 | >= 1 | MET |" in md  # the script after it still ran
    assert "**Out of time:** slow" in md and "1 ratio(s) not measured: y" in md
    assert "budget ran out: slow" in capsys.readouterr().err
    assert '"not_measured"' in (out / "slow.json").read_text()


def test_default_sizing_fits_60_percent_of_the_budget(run_all) -> None:
    """The expected seconds the defaults are sized to (a slow, busy 2-core machine) add up to
    at most ~60% of the default budget."""
    assert sum(b[2] for b in run_all.BENCHES.values()) <= 0.6 * run_all.DEFAULT_BUDGET_S
