"""`ncpctl.fsutil`: atomic writes that fsync the file and its directory, and the files ncpctl
presents as complete that go through it (checkpoint model files, recipe.resolved.yaml, the
indexed-dataset builder, the metrics log rewrite)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ncpctl import fsutil


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> set[tuple[int, int]]:
    """(device, inode) of everything os.fsync is called on (a renamed file keeps its inode)."""
    seen: set[tuple[int, int]] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        seen.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def key(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def test_atomic_write_writes_fsyncs_and_leaves_no_tmp(tmp_path: Path, synced: set) -> None:
    target = tmp_path / "out.json"
    assert fsutil.atomic_write(target, '{"a": 1}\n') == target
    assert target.read_text() == '{"a": 1}\n'
    fsutil.atomic_write(tmp_path / "raw.bin", b"\x00\x01")
    assert (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "raw.bin"]  # no temporary left
    assert key(target) in synced and key(tmp_path / "raw.bin") in synced  # the data
    assert key(tmp_path) in synced  # and the rename


def test_a_failing_writer_leaves_the_old_file(tmp_path: Path, synced: set) -> None:
    target = tmp_path / "model.safetensors"
    target.write_text("old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fsutil.atomic_write_with(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]

    def interrupted(tmp: Path) -> None:
        tmp.write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # an interrupt mid-write is no different
        fsutil.atomic_write_with(target, interrupted)
    assert target.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_writer_variant_for_path_taking_libraries(tmp_path: Path, synced: set) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    target = tmp_path / "w.safetensors"
    fsutil.atomic_write_with(target, lambda tmp: save_file({"x": torch.arange(3.0)}, str(tmp)))
    assert torch.equal(load_file(str(target))["x"], torch.arange(3.0))
    assert key(target) in synced and [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_fsync_tree_syncs_every_file_and_directory(tmp_path: Path, synced: set) -> None:
    root = tmp_path / ".export.tmp"
    (root / "sub").mkdir(parents=True)
    files = [root / "config.json", root / "sub" / "a.bin", root / "sub" / "b.bin"]
    for f in files:
        f.write_text(f.name)
    fsutil.fsync_tree(root)
    assert {key(p) for p in (*files, root, root / "sub")} <= synced


def test_checkpoint_model_files_are_fsynced(tmp_path: Path, synced: set) -> None:
    import torch

    from ncpctl.checkpoint import META, TOKENIZER, WEIGHTS, save_model_files

    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    ck = tmp_path / "step_0000001"
    save_model_files(ck, {"w": torch.ones(2)}, step=1, tokens_seen=8, recipe=None, tokenizer_path=tok,
                     extra={"model_config": {}})
    assert sorted(p.name for p in ck.iterdir()) == sorted([META, WEIGHTS, TOKENIZER])
    assert {key(ck / n) for n in (META, WEIGHTS, TOKENIZER)} | {key(ck)} <= synced
    assert json.loads((ck / META).read_text())["step"] == 1


def test_resolved_recipe_is_fsynced(tmp_path: Path, synced: set) -> None:
    from ncpctl.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\nmodel: {{size: debug}}\n")
    out = load_recipe(p).write_resolved(tmp_path / "run")
    assert key(out) in synced and sorted(x.name for x in out.parent.iterdir()) == ["recipe.resolved.yaml"]


def test_indexed_builder_fsyncs_bin_and_idx(tmp_path: Path, synced: set) -> None:
    import numpy as np

    from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "train", np.uint16) as w:
        w.add_document(np.array([1, 2, 0], dtype=np.uint16))
    assert {key(tmp_path / "train.bin"), key(tmp_path / "train.idx"), key(tmp_path)} <= synced
    assert len(IndexedDataset(tmp_path / "train")) == 1


def test_metrics_log_rewrite_is_fsynced(tmp_path: Path, synced: set) -> None:
    from ncpctl.train.metrics import METRICS, MetricsLog

    (tmp_path / METRICS).write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=2, warn=print)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / METRICS).read_text().splitlines()] == [1, 2]
    assert key(tmp_path / METRICS) in synced and sorted(p.name for p in tmp_path.iterdir()) == [METRICS]


def test_directory_fsync_is_skipped_where_the_filesystem_cannot(tmp_path: Path, monkeypatch) -> None:
    import errno

    def refuse(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", refuse)
    fsutil.atomic_write(tmp_path / "f", "ok")  # no error: the file itself was synced
    assert (tmp_path / "f").read_text() == "ok"
