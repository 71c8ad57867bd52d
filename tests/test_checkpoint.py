"""`ncpctl.checkpoint.run_dir_of`: the one rule for "the run directory of a checkpoint", and the
defaults that follow from it (eval results, export, the offline tasks' data)."""

from __future__ import annotations

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
