"""Shared test fixtures. No network: hub access is forced offline for every test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

from tests.scheduling import (  # noqa: E402,F401 - hooks: which tests share a worker
    pytest_collection_modifyitems, pytest_configure, pytest_unconfigure, pytest_xdist_make_scheduler)

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"

# Hypothesis (tests/test_properties.py): "ci", the default, is derandomised (the same examples on every
# run), has no deadline (two loaded cores make any per-example time limit flaky) and no example
# database (nothing written under .hypothesis/, no example carried from one run to the next: a
# failure found once is kept in the test as an @example). HYPOTHESIS_PROFILE=dev explores instead.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=60, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def ncpctl_cmd() -> list[str]:
    """The real entry point: the installed console script next to this interpreter."""
    script = Path(sys.executable).parent / "ncpctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ncpctl"]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([*ncpctl_cmd(), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout, **kw)


def run_cli_piped(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real entry point as from a user's shell with stdout piped (``ncpctl ... | head``): stdin an
    80-column terminal (a pty), stdout and stderr pipes, ``TERM=xterm`` and no ``COLUMNS``."""
    import fcntl
    import pty
    import struct
    import termios

    terminal, user = pty.openpty()
    fcntl.ioctl(user, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(TERM="xterm", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        return subprocess.run([*ncpctl_cmd(), *args], stdin=user, capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=timeout)
    finally:
        os.close(user)
        os.close(terminal)


# prepended to the code run_without_ncpctl runs: the venv has ncpctl installed, so it is hidden
HIDE_NCPCTL = """\
import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ncpctl" or name.startswith("ncpctl."):
            raise ImportError("ncpctl is hidden")
sys.meta_path.insert(0, _Hide())
try:
    import ncpctl
    raise SystemExit("ncpctl importable")
except ImportError:
    pass
"""


def run_without_ncpctl(code: str, tmp_path: Path, timeout: float = 180) -> str:
    """Run ``code`` (dedented) in an isolated interpreter where ncpctl cannot be imported (an
    export must work with transformers and its own remote code only), offline, with the remote
    modules cached under tmp_path; asserts exit 0 and returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    r = subprocess.run([sys.executable, "-I", "-c", HIDE_NCPCTL + textwrap.dedent(code)], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Trained debug checkpoints (tests/evaluate/_fixtures.py) for the eval, generate, export and bench
    tests: built once per test run for every xdist worker, read-only (a test that writes copies it)."""
    from .evaluate._fixtures import shared_runs

    yield from shared_runs(tmp_path_factory)


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    """A small corpus of text files: deterministic, varied, a few KB each."""
    root = tmp_path / "corpus"
    root.mkdir()
    words = ("concept", "token", "block", "codebook", "segment", "predict", "next", "mean", "pool", "layer")
    for i in range(24):
        body = " ".join(words[(i * 7 + j * 3) % len(words)] + str((i + j) % 13) for j in range(400))
        (root / f"doc{i:02d}.txt").write_text(f"# document {i}\n{body}\n")
    return root
