"""`ncpctl.train.checkpoint.save` with a stand-in engine: every file of the checkpoint (the
engine's own, the RNG state, the inference view) is fsynced before `latest` names it, and
`latest` itself is written atomically and fsynced."""

from __future__ import annotations

import os
from pathlib import Path

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
    from ncpctl.model.config import build_config

    cfg = build_config("debug", concept=dict(enabled=True)).to_dict()
    old = {**cfg, "concept": {k: v for k, v in cfg["concept"].items() if k != "vq_reduction"}}
    ckpt.check_compatible(tmp_path, {"model_config": old}, cfg, world_size=1, zero_stage=0, optimizer_state=False)
    other = {**cfg, "concept": {**cfg["concept"], "vq_reduction": "sum_segment"}}
    with pytest.raises(UserError, match="vq_reduction"):
        ckpt.check_compatible(tmp_path, {"model_config": old}, other, world_size=1, zero_stage=0, optimizer_state=False)
