"""The training-curve columns of ``eval --compare`` (ncpctl/evaluate/compare_curves.py) on
hand-written metrics.jsonl files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.evaluate.compare_curves import curve_stats


def _run(tmp: Path, name: str, slope: float) -> tuple[Path, dict]:
    """A run logging train records every 10 steps (tokens = 1000 x step) and validating every 25
    steps (val loss 5 - slope x step): eval_every is not a multiple of log_every, so steps 25 and 75
    have no train record of their own."""
    d = tmp / name
    d.mkdir()
    steps = [25, 50, 75, 100]
    recs = [{"split": "train", "step": s, "tokens": 1000 * s, "loss": 1.0} for s in range(10, 101, 10)]
    recs += [{"split": "val", "step": s, "ntp_loss": 5 - slope * s} for s in steps]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d, {"key": "ntp_loss", "steps": steps, "values": [5 - slope * s for s in steps]}


def test_tokens_to_reach_between_validations_without_a_train_record(tmp_path):
    """The other run reaches the baseline's final 1.0 at step 62.5 (between its validations at 50
    and 75): 62,500 tokens, ratio 0.625; a validation step with no train record must get its tokens
    from the train records around it, not its step number."""
    a, ca = _run(tmp_path, "base", 0.04)  # 1.0 at step 100 (100,000 tokens)
    b, cb = _run(tmp_path, "other", 0.064)  # 3.4, 1.8, 0.2 at steps 25, 50, 75
    runs = [{"label": "base"}, {"label": "other"}]
    got = curve_stats(runs, [a, b], {"base": ca, "other": cb}, last=20)
    assert got["other"]["tokens_to_reach"] == pytest.approx(62_500)
    assert got["other"]["tokens_ratio"] == pytest.approx(0.625)
    assert got["base"]["tokens_to_reach"] == pytest.approx(100_000)


def test_a_run_that_validated_once_says_why_there_is_no_tokens_to_reach(tmp_path):
    """`n/a: n/a (ratio n/a, compute ratio n/a)` said nothing: the line names the run and the reason."""
    from ncpctl.evaluate.compare_curves import lines

    a, ca = _run(tmp_path, "base", 0.04)
    once = tmp_path / "once"
    once.mkdir()
    (once / "metrics.jsonl").write_text(json.dumps({"split": "val", "step": 40, "ntp_loss": 2.0}) + "\n")
    runs = [{"label": "base"}, {"label": "once"}, {"label": "none"}]
    got = curve_stats(runs, [a, once, None], {"base": ca, "once": {"key": "ntp_loss", "steps": [40], "values": [2.0]}},
                      last=20)
    text = lines(got, "base")
    assert "n/a: n/a" not in " ".join(text)
    assert text[1].endswith("not computed (once validated once (step 40): a crossing needs two validations or more "
                            "(train.eval_every))")
    assert text[2].endswith("not computed (none has no validation records in its metrics.jsonl)")
