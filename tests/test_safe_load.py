"""Opening a checkpoint runs no code from it (issue 21 item 1) and a damaged one is one line
naming the file (item 5): ``ncpctl.safe_load`` for ``.pt`` and safetensors files, the RNG state
in a weights_only format, strategies a checkpoint names imported only when the user names them
too, and ``python -m ncpctl`` without the working directory on the import path.

Each malicious file, were it unpickled or imported, would create ``MARKER``; every refusal
asserts that it does not exist. (The DeepSpeed files of a real resume: tests/train/test_safe_resume.py.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ncpctl.errors import UserError
from ncpctl.safe_load import deepspeed_loads_safely, load_pt, load_safetensors
from ncpctl.train import checkpoint as ckpt

from .conftest import REPO, run_cli

FIXTURE = REPO / "tests" / "fixtures" / "ckpt_v1_neox"


class _Evil:
    """Unpickling calls ``os.system`` (what the tester planted in rng_rank0.pt)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> Path:
    """A ``.pt`` file at ``path`` whose unpickling would create ``marker``."""
    torch.save({"state": _Evil(marker)}, path)
    return path


def one_line(e: UserError, path: Path) -> str:
    assert len(e.problems) == 1 and "\n" not in e.problems[0]
    assert str(path) in e.problems[0]
    return e.problems[0]


def test_a_malicious_rng_file_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    plant(tmp_path / "rng_rank0.pt", marker)
    with pytest.raises(UserError) as e:
        ckpt.load_rng(tmp_path, 0)
    assert "refused to load" in one_line(e.value, tmp_path / "rng_rank0.pt") and "posix.system" in e.value.problems[0]
    assert not marker.exists()
    torch.load(tmp_path / "rng_rank0.pt", weights_only=False)  # the file does run code when unpickled
    assert marker.exists()


def test_deepspeed_loads_go_through_the_allow_list(tmp_path: Path) -> None:
    """DeepSpeed passes weights_only=False; inside the context manager that is ignored."""
    marker, real = tmp_path / "ran", torch.load
    path = plant(tmp_path / "mp_rank_00_model_states.pt", marker)
    with deepspeed_loads_safely(), pytest.raises(UserError) as e:
        torch.load(path, map_location="cpu", weights_only=False)
    one_line(e.value, path)
    assert not marker.exists() and torch.load is real
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"zero_stage": ZeroStageEnum.gradients, "w": torch.ones(2)}, tmp_path / "ok.pt")
    with deepspeed_loads_safely():
        assert torch.load(tmp_path / "ok.pt", weights_only=False)["zero_stage"] is ZeroStageEnum.gradients
    with pytest.raises(UserError):  # the DeepSpeed allow-list holds only inside the context
        load_pt(tmp_path / "ok.pt")


def test_rng_state_round_trips_in_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # numpy's cached gaussian is part of its state too
    torch.save(ckpt.rng_state(), tmp_path / "rng_rank0.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "rng_rank0.pt")) == []
    ckpt.load_rng(tmp_path, 0)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected
    # a file written before issue 21 (numpy's state as an array) still loads
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": None}
    torch.save(old, tmp_path / "rng_rank0.pt")
    expected = np.random.standard_normal(3).tolist()
    ckpt.load_rng(tmp_path, 0)
    assert np.random.standard_normal(3).tolist() == expected


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_pt_file_is_one_line_naming_it(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(64, 64)}}, path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"not a checkpoint" * 8}[damage])
    with pytest.raises(UserError) as e, deepspeed_loads_safely():
        torch.load(path, weights_only=False)
    assert "truncated" in one_line(e.value, path)


@pytest.mark.parametrize("cut", [0, 7, 100, -1000])
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "model.safetensors"
    data = (FIXTURE / "model.safetensors").read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(UserError) as e:
        load_safetensors(path)
    assert "damaged or truncated" in one_line(e.value, path)


def test_generate_on_a_truncated_weights_file_exits_2_naming_it(tmp_path: Path) -> None:
    ck = Path(shutil.copytree(FIXTURE, tmp_path / "ck"))
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    proc = run_cli("generate", str(ck), "-p", "def", "-n", "2")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and str(weights) in errors[0], proc.stderr[-2000:]
    assert "internal error" not in proc.stderr


EVIL_STRATEGY = """\
from pathlib import Path
Path({marker!r}).write_text("imported")
from ncpctl.model.core.segment import FixedBlocks


class Seg(FixedBlocks):
    pass
"""


def _checkpoint_naming(tmp_path: Path, target: str) -> tuple[Path, Path, Path]:
    """A copy of the fixture whose ncpctl.json names ``target`` as its segmentation, the module
    (in ``tmp_path/plugins``) that would create the marker when imported, and the marker."""
    ck, marker, plugins = Path(shutil.copytree(FIXTURE, tmp_path / "ck")), tmp_path / "imported", tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{target.split(':')[0]}.py").write_text(EVIL_STRATEGY.format(marker=str(marker)))
    meta = json.loads((ck / "ncpctl.json").read_text())
    meta["model_config"]["concept"]["segmentation"] = target
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    return ck, plugins, marker


def test_a_strategy_only_the_checkpoint_names_is_not_imported(tmp_path: Path, monkeypatch) -> None:
    from ncpctl.checkpoint import load_model
    from ncpctl.model import registry
    from ncpctl.model.core import config
    ck, plugins, marker = _checkpoint_naming(tmp_path, "ckpt_plugin_a:Seg")
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setattr(registry, "_TRUSTED", set())  # the registry holds the trusted import paths
    with pytest.raises(UserError) as e:
        load_model(ck)
    assert "--strategy ckpt_plugin_a:Seg" in one_line(e.value, ck / "ncpctl.json")
    assert not marker.exists() and "ckpt_plugin_a" not in sys.modules
    config.trust("ckpt_plugin_a:Seg")  # what --strategy does: the user names it
    assert type(load_model(ck).model.concept.segmenter).__name__ == "Seg" and marker.exists()


def test_midtrain_from_a_checkpoint_naming_a_strategy_reports_it(tmp_path: Path, monkeypatch) -> None:
    """A recipe with only train.init_from takes the model from the checkpoint: its import path is
    a recipe problem (one line, nothing imported) until the user names it."""
    from ncpctl.model import registry
    from ncpctl.model.core import config
    from ncpctl.recipe import load_recipe

    ck, plugins, marker = _checkpoint_naming(tmp_path, "ckpt_plugin_c:Seg")
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setattr(registry, "_TRUSTED", set())  # the registry holds the trusted import paths
    recipe = tmp_path / "mid.yaml"
    recipe.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ntrain: {{init_from: {ck}}}\n")
    with pytest.raises(UserError) as e:
        load_recipe(recipe)
    assert "train.init_from" in one_line(e.value, ck) and "--strategy ckpt_plugin_c:Seg" in e.value.problems[0]
    assert not marker.exists()
    config.trust("ckpt_plugin_c:Seg")
    assert load_recipe(recipe).model_config.concept.segmentation == "ckpt_plugin_c:Seg" and marker.exists()


def test_generate_imports_a_checkpoint_strategy_only_with_the_flag(tmp_path: Path) -> None:
    """The real entry point: refused (one line, nothing imported), then run with --strategy."""
    ck, plugins, marker = _checkpoint_naming(tmp_path, "ckpt_plugin_b:Seg")
    env = {**os.environ, "PYTHONPATH": str(plugins), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "ncpctl", "generate", str(ck), "-p", "def", "-n", "2", "--greedy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "named only by the checkpoint" in errors[0], proc.stderr
    assert not marker.exists()
    proc = subprocess.run([*cmd, "--strategy", "ckpt_plugin_b:Seg"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-2000:]


def test_python_m_ncpctl_does_not_import_from_the_working_directory(tmp_path: Path) -> None:
    """A ``typer.py`` where the user stands (a downloaded checkpoint's folder) would shadow the
    real typer, which ``ncpctl --help`` imports."""
    marker = tmp_path / "ran"
    (tmp_path / "typer.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "ncpctl", "--help"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout, proc.stderr
    assert not marker.exists()
