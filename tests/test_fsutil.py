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


# ----------------------------------------------------------------------------- a full or read-only disk
# Mocked: the tests run as root, where chmod does not make a directory read-only.

import errno  # noqa: E402

from ncpctl.errors import UserError  # noqa: E402


class _FullFile:
    """A file whose writes fail the way a full disk's do (OSError ENOSPC, no file name)."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("code, meaning", [(errno.ENOSPC, "no space left on device"),
                                           (errno.EROFS, "read-only file system"),
                                           (errno.EACCES, "permission denied")])
def test_disk_errors_name_the_file_and_what_is_wrong(code: int, meaning: str, tmp_path: Path) -> None:
    with pytest.raises(UserError) as e, fsutil.disk_errors(tmp_path / "run"):
        raise OSError(code, os.strerror(code))  # a write(): no file name of its own
    assert e.value.problems == [f"{meaning} writing {tmp_path / 'run'}"]
    with pytest.raises(UserError) as e, fsutil.disk_errors(tmp_path / "run"):
        raise OSError(code, os.strerror(code), str(tmp_path / "run" / "x.bin"))  # an open(): its own file
    assert e.value.problems == [f"{meaning} writing {tmp_path / 'run' / 'x.bin'}"]
    with pytest.raises(OSError), fsutil.disk_errors(tmp_path):  # anything else stays a bug
        raise OSError(errno.EBADF, "bad file descriptor")


def test_torch_s_write_error_without_errno_is_diagnosed_from_the_file_system(tmp_path: Path, monkeypatch) -> None:
    """Issue 21: a full disk said `unexpected pos 4025536 vs 4025428` (torch's writer), exit 1."""
    with pytest.raises(RuntimeError), fsutil.disk_errors(tmp_path):  # space left: not the disk's fault
        raise RuntimeError("unexpected pos 4025536 vs 4025428")
    real = os.statvfs(tmp_path)
    full = os.statvfs_result((*real[:4], 0, *real[5:]))  # f_bavail = 0
    monkeypatch.setattr(os, "statvfs", lambda p: full)
    with pytest.raises(UserError, match=rf"^no space left on device writing {tmp_path}/rng.pt \(unexpected pos"):
        with fsutil.disk_errors(tmp_path / "rng.pt"):
            raise RuntimeError("unexpected pos 4025536 vs 4025428")
    ro = os.statvfs_result((*real[:8], real[8] | os.ST_RDONLY, *real[9:]))
    monkeypatch.setattr(os, "statvfs", lambda p: ro)
    with pytest.raises(UserError, match="^read-only file system writing"), fsutil.disk_errors(tmp_path / "rng.pt"):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")


def test_atomic_write_names_its_file_on_a_full_disk_and_keeps_the_old_one(tmp_path: Path, monkeypatch) -> None:
    import builtins

    target = tmp_path / "latest"
    target.write_text("step_0000003\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, mode="r", *a, **k: _FullFile(real_open(f, mode, *a, **k))
                        if "w" in mode else real_open(f, mode, *a, **k))
    with pytest.raises(UserError, match=f"^no space left on device writing {target}$"):
        fsutil.atomic_write(target, "step_0000006\n")
    monkeypatch.undo()
    assert target.read_text() == "step_0000003\n" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_full_disk_while_logging_metrics_names_metrics_jsonl(tmp_path: Path) -> None:
    from ncpctl.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, False, None, print)
    log.file = _FullFile(log.file)
    with pytest.raises(UserError, match=f"^no space left on device writing {tmp_path / 'metrics.jsonl'}$"):
        log.write({"split": "train", "step": 1})
    log.close()


def test_a_full_disk_while_tokenizing_names_the_file_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    """Issue 21: a full disk was `internal error` (exit 1) with no word of ENOSPC."""
    import builtins

    from ncpctl.data.tokenize import tokenize
    from ncpctl.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  sources: [builtin:python-stdlib]\n  max_documents: 20\n"
                      f"tokenizer:\n  vocab_size: 300\nrun:\n  dir: {tmp_path / 'run'}\n")
    real_open = builtins.open

    def full_for_bin(f, mode="r", *a, **k):
        handle = real_open(f, mode, *a, **k)
        return _FullFile(handle) if "w" in mode and str(f).endswith(".bin.tmp") else handle

    monkeypatch.setattr(builtins, "open", full_for_bin)
    with pytest.raises(UserError) as e:
        tokenize(load_recipe(recipe))
    (line,) = e.value.problems
    assert line.startswith(f"no space left on device writing {tmp_path / 'run'}/.data.tmp-")
    assert line.endswith(".bin.tmp")
    assert not (tmp_path / "run" / "data").exists() and not list((tmp_path / "run").glob(".data.*"))
