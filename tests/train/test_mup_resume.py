"""Decoupled muP in the real training loop: per-module lr groups are logged as the schedule
says, and a run killed inside a checkpoint write resumes bit for bit (the group names, lrs and
epsilons come back from the DeepSpeed checkpoint)."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from .conftest import losses, ncpctl, result, weights

MUP = ["--set", "model.mup_base_width=32", "--set", "train.max_steps=6", "--set", "train.eval_every=6"]


def test_mup_resume_is_bit_identical(make_recipe, tmp_path: Path) -> None:
    ref = make_recipe("mup_ref")
    r = result(ncpctl("pretrain", str(ref), *MUP, "--json"))
    assert r["step"] == 6
    crash = make_recipe("mup_crash")
    proc = ncpctl("pretrain", str(crash), *MUP, env={"NCPCTL_FAULT": "kill_in_save@6"})
    assert proc.returncode == -signal.SIGKILL
    r = result(ncpctl("pretrain", str(crash), *MUP, "--json"))
    assert r["resumed_from"].endswith("step_0000003") and r["step"] == 6
    assert losses(tmp_path / "mup_crash") == losses(tmp_path / "mup_ref")
    a = weights(tmp_path / "mup_ref" / "checkpoints" / "step_0000006")
    b = weights(tmp_path / "mup_crash" / "checkpoints" / "step_0000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
