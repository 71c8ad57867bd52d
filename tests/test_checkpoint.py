"""`ncpctl.checkpoint.run_dir_of`: the one rule for "the run directory of a checkpoint", and the
defaults that follow from it (eval results, export, the offline tasks' data)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from ncpctl.checkpoint import CHECKPOINTS, run_dir_of

PKG = Path(__file__).resolve().parents[1] / "ncpctl"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ckpt_v1_neox"


def test_run_dir_of() -> None:
    assert run_dir_of(Path("runs/debug/checkpoints/step_0000300")) == Path("runs/debug")
    assert run_dir_of(Path("/abs/run/checkpoints/step_1")) == Path("/abs/run")
    assert run_dir_of(Path("/somewhere/my_ckpt")) is None  # a checkpoint outside a run directory
    assert run_dir_of(Path("/x/checkpoints.prev-2026/step_1")) is None


def test_no_module_has_its_own_copy_of_the_rule() -> None:
    """The layout name appears only in ncpctl/checkpoint.py; nobody walks `.parent.parent` to a run dir."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "checkpoint.py" and path.parent == PKG:
            continue
        text = path.read_text()
        if re.search(r"""["']checkpoints["']""", text) or ".parent.parent" in text:
            offenders.append(str(path.relative_to(PKG)))
    assert offenders == []


@pytest.fixture
def placed(tmp_path: Path) -> dict[str, Path]:
    """The committed tiny checkpoint inside a run directory and outside one."""
    inside = tmp_path / "run" / CHECKPOINTS / "step_0000020"
    shutil.copytree(FIXTURE, inside)
    (inside.parent / "latest").write_text(inside.name + "\n")
    outside = tmp_path / "loose"
    shutil.copytree(FIXTURE, outside)
    return {"run": tmp_path / "run", "inside": inside, "outside": outside}


def test_eval_output_goes_to_the_run_dir(placed: dict[str, Path]) -> None:
    from ncpctl.evaluate.run import resolve_target

    for target in (placed["run"], placed["inside"]):
        assert resolve_target(str(target), [], None, None, None, None, None).out_dir == placed["run"] / "eval"
    assert resolve_target(str(placed["outside"]), [], None, None, None, None, None).out_dir == \
        placed["outside"] / "eval"


def test_offline_tasks_find_the_data_of_the_run(placed: dict[str, Path]) -> None:
    from ncpctl.evaluate.offline import data_dir_for

    data = placed["run"] / "data"
    data.mkdir()
    for name in ("val.bin", "val.idx"):
        (data / name).write_bytes(b"")
    assert data_dir_for(str(placed["inside"])) == (data, placed["run"] / "eval" / "offline")


def _latest_as(kind: str, latest: Path, tmp_path: Path) -> None:
    """Replace ``latest`` (a file naming step_0000020) by a directory, a link or a FIFO."""
    latest.unlink()
    if kind == "directory":
        latest.mkdir()
    elif kind == "symlink-to-file":  # the tag it reaches is even right: ncpctl never writes a link there
        (tmp_path / "elsewhere").write_text("step_0000020\n")
        latest.symlink_to(tmp_path / "elsewhere")
    elif kind == "symlink-to-dir":
        latest.symlink_to(tmp_path)
    else:  # a FIFO: reading it would wait for a writer forever
        os.mkfifo(latest)


@pytest.mark.parametrize("kind", ["directory", "symlink-to-file", "symlink-to-dir", "fifo"])
def test_a_latest_that_is_not_a_regular_file_is_one_line_for_eval_and_export(placed: dict[str, Path], kind: str,
                                                                             tmp_path: Path) -> None:
    """Issue 42 item 6: ``checkpoints/latest`` as a directory or a symbolic link (or a FIFO) was an
    internal IsADirectoryError (or a hang); eval and export of the run directory now stop with one
    line naming it, exit 2 (through the real command, in-process)."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    latest = placed["run"] / CHECKPOINTS / "latest"
    _latest_as(kind, latest, tmp_path)
    for argv in (["export", str(placed["run"]), "--out", str(tmp_path / "hf"), "--skip-verify"],
                 ["eval", str(placed["run"]), "--tasks", "ncp_cloze", "--limit", "2"]):
        r = CliRunner().invoke(app, argv, env={"COLUMNS": "400"})
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1, (argv[0], r.stderr)
        assert errors[0].startswith(f"error: {latest}: is ") and "not the one-line file ncpctl writes" in errors[0]
    assert not (tmp_path / "hf").exists() and not (placed["run"] / "eval").exists()
