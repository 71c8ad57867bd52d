"""metrics.jsonl on resume: a torn last line is cut with a warning (issue 21 item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.train.metrics import MetricsLog, read_metrics


def test_a_torn_last_line_is_cut_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    """Issue 21: a torn line made every resume fail with a JSONDecodeError naming no file."""
    path = tmp_path / "metrics.jsonl"
    whole = [{"split": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"split": "train", "step": 4, "lo')
    warnings: list[str] = []
    MetricsLog(tmp_path, False, 3, warnings.append).close()
    assert read_metrics(tmp_path) == whole and path.read_text().endswith("}\n")
    assert len(warnings) == 1 and f"{path}: cut its torn last line 4" in warnings[0]


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match=rf"{path}:2: not a metrics record"):
        MetricsLog(tmp_path, False, 2, print)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'  # left as it was
