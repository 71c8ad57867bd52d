"""Issue 46 item 4: tables printed to a pipe (``ncpctl ... | head``) keep their full width. rich
caps a table at the console's width, which piped is the terminal's that stdin still is (or 80
columns): a sweep's point names were folded and ``eval --compare``'s task names cut. Run as a
user's shell has it (``run_cli_piped``: no COLUMNS, TERM=xterm, stdin a terminal); the compare
case is tests/evaluate/test_compare.py's piped check."""

from __future__ import annotations

from pathlib import Path

from ..conftest import RECIPES, run_cli_piped


def test_a_dry_sweep_table_prints_whole_names_when_piped(tmp_path: Path) -> None:
    sweep = tmp_path / "wide.yaml"
    sweep.write_text(f"name: wide\nbase: {RECIPES / 'debug.yaml'}\naxes:\n  train.lr: [0.001, 0.003]\n"
                     "  train.warmup_steps: [10, 20]\n  train.min_lr: [0.0001, 0.00003]\n  model.concept.codes: [16, 32]\n"
                     "  train.weight_decay: [0.1, 0.01]\n")
    r = run_cli_piped("sweep", str(sweep), "--dry", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert max(len(line) for line in r.stdout.splitlines()) > 80  # wider than the terminal: the case at hand
    rows = [line.split("│")[1:-1] for line in r.stdout.splitlines() if line.startswith("│")]
    # 32 points and the total, one line each: a folded name would continue on a line of empty cells
    assert len(rows) == 33 and all(cells[-1].strip() for cells in rows), r.stdout
