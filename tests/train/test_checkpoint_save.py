"""`ncpctl.train.checkpoint.save` with a stand-in engine: every file of the checkpoint (the
engine's own, the RNG state, the inference view) is fsynced before `latest` names it, and
`latest` itself is written atomically and fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ncpctl.recipe import load_recipe
from ncpctl.train import checkpoint as ckpt


class _Engine:
    """What save() uses of a DeepSpeed engine: save_checkpoint(dir, tag=) and module."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)

    def save_checkpoint(self, root: str, tag: str, save_latest: bool) -> None:
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"engine state")


def test_every_checkpoint_file_is_fsynced_before_latest(tmp_path: Path, monkeypatch) -> None:
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"run: {{dir: {tmp_path / 'run'}}}\nmodel: {{size: debug}}\n")
    recipe = load_recipe(recipe_path)
    order: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        order.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "run" / "checkpoints"
    path = ckpt.save(_Engine(), root, 3, {"zero_stage": 0, "tokens_seen": 24}, recipe, rank=0, keep_last=2,
                     barrier=lambda: None)
    key = lambda p: (p.stat().st_dev, p.stat().st_ino)  # noqa: E731
    files = [p for p in path.iterdir()]
    assert {p.name for p in files} >= {"mp_rank_00_model_states.pt", "rng_rank0.pt", "model.safetensors",
                                       "ncpctl.json", "recipe.resolved.yaml"}
    latest = root / ckpt.LATEST
    assert latest.read_text() == "step_0000003\n" and sorted(p.name for p in root.iterdir()) == ["latest", path.name]
    first_latest = order.index(key(latest))
    for p in [*files, path]:
        assert key(p) in order[:first_latest], p.name  # on the device before latest names the checkpoint
    assert key(root) in order[first_latest:]  # and the rename of latest itself


def test_a_checkpoint_from_before_a_new_config_key_is_compatible(tmp_path: Path) -> None:
    """A key added to ModelConfig later (here concept.vq_reduction) compares as its default."""
    import pytest

    from ncpctl.errors import UserError
    from ncpctl.model.core.config import build_config

    cfg = build_config("debug", concept=dict(enabled=True)).to_dict()
    old = {**cfg, "concept": {k: v for k, v in cfg["concept"].items() if k != "vq_reduction"}}
    ckpt.check_compatible(tmp_path, {"model_config": old}, cfg, world_size=1, zero_stage=0, optimizer_state=False)
    other = {**cfg, "concept": {**cfg["concept"], "vq_reduction": "sum_segment"}}
    with pytest.raises(UserError, match="vq_reduction"):
        ckpt.check_compatible(tmp_path, {"model_config": old}, other, world_size=1, zero_stage=0, optimizer_state=False)


def _saved(tmp_path: Path, steps: tuple[int, ...] = (3, 6, 9), keep_last: int = 3) -> Path:
    """``run/checkpoints`` with the stand-in engine's checkpoints of ``steps``."""
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"run: {{dir: {tmp_path / 'run'}}}\nmodel: {{size: debug}}\n")
    recipe, root = load_recipe(recipe_path), tmp_path / "run" / "checkpoints"
    for s in steps:
        ckpt.save(_Engine(), root, s, {"zero_stage": 0, "tokens_seen": 8 * s}, recipe, rank=0,
                  keep_last=keep_last, barrier=lambda: None)
    return root


def _flip_a_bit(path: Path, at: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_size_and_checksum(tmp_path: Path) -> None:
    import json

    from ncpctl import manifest

    path = _saved(tmp_path, (3,)) / "step_0000003"
    files = json.loads((path / "manifest.json").read_text())
    assert files["algorithm"] == "xxh3_128"
    assert sorted(files["files"]) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert files["files"]["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    assert manifest.verify(path) is None
    _flip_a_bit(path / "mp_rank_00_model_states.pt")
    assert manifest.verify(path) == "mp_rank_00_model_states.pt does not match its xxh3_128 checksum (damaged on disk)"
    assert manifest.verify(path, sizes_only=True) is None
    _flip_a_bit(path / "mp_rank_00_model_states.pt")  # flipped back
    (path / "rng_rank0.pt").write_bytes(b"cut")
    assert manifest.verify(path).startswith("rng_rank0.pt has 3 bytes, the manifest says")


@pytest.mark.parametrize("damage", ["garbage_latest", "missing_latest", "bit_flip"])
def test_a_damaged_checkpoints_dir_falls_back_to_the_newest_verified_checkpoint(damage: str, tmp_path: Path) -> None:
    """Issue 21: a garbage `latest` restarted the run from step 0 and moved the good checkpoints aside;
    a bit-flipped checkpoint was resumed silently."""
    from ncpctl.checkpoint import resolve

    root = _saved(tmp_path)
    warnings: list[str] = []
    if damage == "garbage_latest":
        (root / "latest").write_text("garbage")
        want, said = "step_0000009", ("latest is damaged ('garbage' is not a checkpoint tag); "
                                      "using the newest complete verified checkpoint, step_0000009")
    elif damage == "missing_latest":
        (root / "latest").unlink()
        want, said = "step_0000009", "latest is missing; using the newest complete verified checkpoint, step_0000009"
    else:
        _flip_a_bit(root / "step_0000009" / "model.safetensors", 100)
        want, said = "step_0000006", "step_0000009: model.safetensors does not match its xxh3_128 checksum"
    assert ckpt.latest_checkpoint(root, warnings.append) == root / want
    assert said in warnings[0] and len(warnings) == (2 if damage == "bit_flip" else 1), warnings
    if damage == "bit_flip":  # the run moves it aside, never deletes it
        assert "moved it to corrupt-step_0000009" in warnings[0] and (root / "corrupt-step_0000009").is_dir()
        assert "latest names step_0000009, which failed verification; using" in warnings[1]
    # a reader neither moves nor deletes anything, and says the same
    (root / "latest").write_text("garbage")
    assert resolve(root.parent, warn=warnings.append) == root / want
    assert sorted(p.name for p in root.glob("*step_*")) == sorted(
        ["step_0000003", "step_0000006"] + (["corrupt-step_0000009"] if damage == "bit_flip" else ["step_0000009"]))


def test_an_explicit_damaged_checkpoint_is_refused_unless_no_verify(tmp_path: Path) -> None:
    from ncpctl.checkpoint import resolve, set_verify
    from ncpctl.errors import UserError

    path = _saved(tmp_path, (3,)) / "step_0000003"
    _flip_a_bit(path / "rng_rank0.pt", 40)
    with pytest.raises(UserError, match="step_0000003: rng_rank0.pt does not match its xxh3_128 checksum"):
        resolve(path)
    set_verify(False)
    try:
        assert resolve(path) == path
    finally:
        set_verify(True)


def test_a_pinned_checkpoint_survives_pruning(tmp_path: Path) -> None:
    """Issue 21: `eval RUN` while training pruned checkpoints failed with `no such checkpoint`. A
    reader in another process (what eval / export / generate do on opening a run directory) pins
    the newest checkpoint; the training run's pruning leaves it until the reader is gone."""
    import subprocess
    import sys

    root = _saved(tmp_path, (3,), keep_last=1)
    reader = subprocess.Popen([sys.executable, "-c", "import sys; from ncpctl.checkpoint import resolve; "
                               "print(resolve(sys.argv[1]), flush=True); sys.stdin.read()", str(root.parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == str(root / "step_0000003")  # pinned
        _saved(tmp_path, (6, 9), keep_last=1)
        assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003", "step_0000009"]
        assert (root / "step_0000003" / "model.safetensors").is_file()
    finally:
        reader.communicate("", timeout=60)  # the reader ends: its pin goes with it
    _saved(tmp_path, (12,), keep_last=1)  # the next save prunes it
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000012"]


def test_pruning_never_counts_or_deletes_a_damaged_checkpoint(tmp_path: Path) -> None:
    """Issue 21: pruning deleted the good checkpoints behind a damaged one. keep_last 2 with step 6
    damaged: step 3 (whole) and step 9 are the two kept; step 6 is left for resume to move aside."""
    root = _saved(tmp_path, (3, 6), keep_last=2)
    (root / "step_0000006" / "rng_rank0.pt").write_bytes(b"")  # damaged after it was written
    _saved(tmp_path, (9,), keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003", "step_0000006", "step_0000009"]
    _saved(tmp_path, (12,), keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000006", "step_0000009", "step_0000012"]


class _FullDiskEngine(_Engine):
    def save_checkpoint(self, root: str, tag: str, save_latest: bool) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4025536 vs 4025428")


def test_a_full_disk_during_a_save_is_one_line_and_latest_stays(tmp_path: Path, monkeypatch) -> None:
    """Issue 21: a full disk during a checkpoint save was `internal error: unexpected pos` (exit 1)."""
    from ncpctl.errors import UserError

    root = _saved(tmp_path, (3,))
    real = os.statvfs(root)
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*real[:4], 0, *real[5:])))  # f_bavail 0
    recipe = load_recipe(tmp_path / "r.yaml")
    with pytest.raises(UserError, match=rf"^no space left on device writing {root}/step_0000006 \(.*unexpected pos"):
        ckpt.save(_FullDiskEngine(), root, 6, {"zero_stage": 0, "tokens_seen": 48}, recipe, rank=0, keep_last=3,
                  barrier=lambda: None)
    assert (root / "latest").read_text() == "step_0000003\n"
