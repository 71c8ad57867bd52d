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
