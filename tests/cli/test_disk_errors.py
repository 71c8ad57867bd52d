"""A full, read-only or forbidden disk through the real entry point: exit 2 and one line naming
the file (issue 21 item 5). Mocked (the tests run as root, where chmod does not make a directory
read-only): ``open`` for writing under the run directory fails with the errno."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MOCK = """\
import builtins, errno, os, sys
code, under = getattr(errno, sys.argv.pop(1)), sys.argv.pop(1)
real_open = builtins.open
class Full:
    def __init__(self, f): self.f = f
    def write(self, data): raise OSError(code, os.strerror(code))
    def __getattr__(self, name): return getattr(self.f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
def mocked(f, mode="r", *a, **k):
    if ("w" in mode or "a" in mode) and str(f).startswith(under):
        if code != errno.ENOSPC:  # a read-only or forbidden place fails at open, naming the file
            raise OSError(code, os.strerror(code), str(f))
        return Full(real_open(f, mode, *a, **k))  # a full disk fails at write
    return real_open(f, mode, *a, **k)
builtins.open = mocked
from ncpctl.cli.app import main
sys.exit(main())
"""


@pytest.mark.parametrize("code, meaning", [("ENOSPC", "no space left on device"), ("EROFS", "read-only file system"),
                                           ("EACCES", "permission denied")])
def test_tokenize_on_a_full_or_read_only_disk_exits_2_naming_the_file(code: str, meaning: str, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  sources: [builtin:python-stdlib]\n  max_documents: 20\n"
                      f"tokenizer:\n  vocab_size: 300\nrun:\n  dir: {tmp_path / 'run'}\n")
    proc = subprocess.run([sys.executable, "-c", MOCK, code, str(tmp_path / "run"), "tokenize", str(recipe)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COLUMNS": "300"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: {meaning} writing {tmp_path / 'run'}/"), errors
    assert "internal error" not in proc.stderr and not (tmp_path / "run" / "data").exists()


def _tiny_run(tmp_path: Path) -> tuple[Path, Path]:
    """A recipe over a small dataset of our own (debug model, 2 steps); (recipe, run dir)."""
    import numpy as np

    from ncpctl.data.indexed import IndexedDatasetWriter

    for split in ("train", "val"):
        with IndexedDatasetWriter(tmp_path / split, np.uint16) as w:
            w.add_documents(np.arange(4000) % 500, np.array([1000] * 4))
    run = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run: {{dir: {run}}}\ndata: {{train_prefix: {tmp_path / 'train'}, val_prefix: "
                      f"{tmp_path / 'val'}}}\ntokenizer: {{vocab_size: 512}}\nmodel: {{size: debug}}\n"
                      "train: {max_steps: 2, micro_batch_size: 2, seq_len: 32}\n")
    return recipe, run


def test_pretrain_refuses_a_lock_that_is_a_directory_in_one_line(tmp_path: Path) -> None:
    """Issue 42 item 6, through the real entry point: ``ncpctl.lock`` as a directory was an
    IsADirectoryError before anything ran. (``checkpoints/latest`` as a directory: the 2-rank test
    below, and eval / export in tests/test_checkpoint.py.)"""
    recipe, run = _tiny_run(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "300", "OMP_NUM_THREADS": "1"}
    (run / "ncpctl.lock").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "ncpctl", "pretrain", str(recipe)], capture_output=True, text=True,
                          timeout=300, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [f"error: {run / 'ncpctl.lock'}: is a directory, not the lock file "
                                               "ncpctl writes there"], proc.stderr[-2000:]
    assert (run / "ncpctl.lock").is_dir() and not (run / "checkpoints").exists()


@pytest.mark.slow  # a 2-rank launch (it stops before the model is built)
def test_a_two_rank_failure_names_each_rank_and_the_cause(tmp_path: Path) -> None:
    """Issue 42 item 6: on 2 ranks ``checkpoints/latest`` as a directory was an internal error on rank
    0 and a gloo line ("Connection closed by peer") on rank 1. Now every rank checks it before rank 0
    alone picks the checkpoint: each rank prints the cause, naming itself; exit 2."""
    from tests.train.conftest import ncpctl

    recipe, run = _tiny_run(tmp_path)
    (run / "checkpoints" / "latest").mkdir(parents=True)
    proc = ncpctl("pretrain", str(recipe), launcher_ranks=2)
    errors = sorted(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    cause = f"{run / 'checkpoints' / 'latest'}: is a directory, not the one-line file ncpctl writes there"
    assert proc.returncode == 2 and errors[0] == f"error: rank 0 of 2: {cause}", proc.stderr[-3000:]
    assert set(errors) <= {f"error: rank {r} of 2: {cause}" for r in (0, 1)}  # rank 1's, unless the launcher stopped it first
    assert "internal error" not in proc.stderr and "gloo" not in proc.stderr
