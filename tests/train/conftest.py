"""Fixtures for the training tests: one tiny tokenized dataset per test run (shared by the xdist
workers), tiny recipes (debug size, seq_len 32, global batch 8), and helpers to run the real
``ncpctl`` entry point (optionally under the ``deepspeed`` launcher) and read what a run wrote.

Faults (NaN losses, a SIGKILL inside a checkpoint write, a pause per step) are injected through
``$NCPCTL_FAULT``, parsed strictly by ``ncpctl.train.faults.Faults``; only these tests set it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ncpctl_cmd
from tests.shared import shared

# One thread per process: only then are runs bit-identical (with more threads the CPU kernels'
# reduction order varies and two runs differ at ~1e-6), and two xdist workers (or two ranks)
# share the 2-core CI machine without oversubscription.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COLUMNS": "200",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

RECIPE = """\
model:
  size: debug
  max_seq_len: 64
  concept: {{enabled: true}}
tokenizer:
  vocab_size: 512
data:
  train_prefix: {data}/train
  val_prefix: {data}/val
run:
  dir: {run}
train:
  max_steps: 12
  seq_len: 32
  micro_batch_size: 4
  global_batch_size: 8
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_steps: 2
  eval_every: 6
  eval_batches: 2
  save_every: 3
  keep_last: 2
deepspeed:
  zero_stage: 0
"""


def _tokenize_tiny(root: Path) -> None:
    recipe = root / "tiny.yaml"
    recipe.write_text(f"data:\n  sources: [builtin:python-stdlib]\n  max_documents: 60\n  val_fraction: 0.1\n"
                      f"tokenizer:\n  vocab_size: 512\nrun:\n  dir: {root / 'run'}\n")
    proc = subprocess.run([*ncpctl_cmd(), "tokenize", str(recipe)], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the offline ncp_* tasks' files, which an evaluation of a run on this data (in the loop, or
    # `ncpctl eval` of its checkpoint) would otherwise write beside it: built here, every test only reads them
    from ncpctl.evaluate.offline import build, data_dir_for

    build(*data_dir_for(data=str(root / "run" / "data")))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``run/data`` of the built-in corpus cut to 60 documents, 512-token BPE (a few seconds): made
    once per test run for every xdist worker, read-only (tests/shared.py; a test that writes copies it)."""
    for root in shared(tmp_path_factory, "tiny-data", _tokenize_tiny, Path(__file__)):
        yield root / "run" / "data"


@pytest.fixture
def make_recipe(tmp_path: Path, tiny_data: Path):
    """``make_recipe(name)`` -> path of a tiny recipe whose run.dir is ``tmp_path/name``."""

    def make(name: str = "run") -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(RECIPE.format(data=tiny_data, run=tmp_path / name))
        return path

    return make


def ncpctl(*args: str, env: dict[str, str] | None = None, launcher_ranks: int = 0, timeout: float = 300,
           ) -> subprocess.CompletedProcess[str]:
    """Run the real entry point; ``launcher_ranks`` > 0 runs it under ``deepspeed --num_gpus N``."""
    cmd = [*ncpctl_cmd(), *args]
    if launcher_ranks:
        port = str(30000 + os.getpid() % 2000)  # xdist workers must not share the rendezvous port
        # the launcher as a module of this interpreter, not the `deepspeed` script: a copied venv's
        # script names the Python it was installed with, whose ranks would run that tree's ncpctl
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(launcher_ranks),
               "--master_port", port, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=timeout)


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*ncpctl_cmd(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(env or {})})


def result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``--json`` object (the last JSON line on stdout)."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def metrics(run_dir: Path, split: str = "train") -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == split]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run_dir)]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Poll metrics.jsonl until it has a training record for ``step`` or later."""
    path, end = run_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, f"run ended before step {step}: {proc.stderr.read()[-2000:]}"
        if path.exists():
            done = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            if any(r.get("split") == "train" and r["step"] >= step for r in done):
                return
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout}s")


def weights(checkpoint: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def crash_and_resume(make_recipe, name: str, sets: list[str]) -> tuple[Path, Path]:
    """Run ``NAME_ref`` uninterrupted to its 6 steps, and ``NAME_crash`` killed (SIGKILL) inside
    its step-6 checkpoint write, then resumed to the end from the last complete checkpoint (step
    3); returns the two run directories."""
    assert result(ncpctl("pretrain", str(make_recipe(f"{name}_ref")), *sets, "--json"))["step"] == 6
    crash = make_recipe(f"{name}_crash")
    proc = ncpctl("pretrain", str(crash), *sets, env={"NCPCTL_FAULT": "kill_in_save@6"})
    assert proc.returncode == -signal.SIGKILL
    # what a kill in the middle of an earlier resume across world sizes leaves: a re-partitioned copy
    from ncpctl.checkpoint import elastic_dir

    stale = elastic_dir(crash.parent / f"{name}_crash") / "step_0000003"
    stale.mkdir(parents=True)
    (stale / "mp_rank_00_model_states.pt").write_bytes(b"half a copy")
    r = result(ncpctl("pretrain", str(crash), *sets, "--json"))
    assert r["resumed_from"].endswith("step_0000003") and r["step"] == 6
    assert not stale.parent.exists()  # removed when the resume needs no re-partitioning
    return crash.parent / f"{name}_ref", crash.parent / f"{name}_crash"


def same_weights(a: Path, b: Path, step: int) -> bool:
    """Whether two runs' checkpoints of ``step`` hold bit-identical weights."""
    import torch

    tag = f"checkpoints/step_{step:07d}"
    wa, wb = weights(a / tag), weights(b / tag)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
