"""DLCM in the real training loop resumes bit for bit: a run killed inside a checkpoint write
continues from the last complete checkpoint with the same sampled boundaries (noise keyed by
the global sample index) and the same Global Parser state (the previous step's global F, the
``rate_counts`` buffer saved with the weights), so its losses, boundary statistics and final
weights equal an uninterrupted run's."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from .conftest import metrics, ncpctl, result, weights

DLCM = ["--set", "model.concept.segmentation=dynamic", "--set", "model.concept.coupling=cross_attention",
        "--set", "model.concept.ncp_weight=0", "--set", "model.concept.vq_weight=0",
        "--set", "train.max_steps=6", "--set", "train.eval_every=6"]
KEYS = ("loss", "balance_loss", "boundary_rate", "boundary_prob", "boundaries")


def test_dlcm_resume_is_bit_identical(make_recipe, tmp_path: Path) -> None:
    r = result(ncpctl("pretrain", str(make_recipe("dlcm_ref")), *DLCM, "--json"))
    assert r["step"] == 6
    crash = make_recipe("dlcm_crash")
    proc = ncpctl("pretrain", str(crash), *DLCM, env={"NCPCTL_FAULT": "kill_in_save@6"})
    assert proc.returncode == -signal.SIGKILL
    r = result(ncpctl("pretrain", str(crash), *DLCM, "--json"))
    assert r["resumed_from"].endswith("step_0000003") and r["step"] == 6
    ref, got = metrics(tmp_path / "dlcm_ref"), metrics(tmp_path / "dlcm_crash")
    ref = {m["step"]: m for m in ref}
    for m in got:  # the killed run's steps 1-6 and the resumed run's 4-6
        assert all(m[k] == ref[m["step"]][k] for k in KEYS), (m["step"], {k: (m[k], ref[m["step"]][k]) for k in KEYS})
    assert [m["step"] for m in got if m["step"] > 3][-3:] == [4, 5, 6]
    assert any(m["balance_loss"] != 0 for m in got)  # F is the previous step's from step 2 on
    a = weights(tmp_path / "dlcm_ref" / "checkpoints" / "step_0000006")
    b = weights(tmp_path / "dlcm_crash" / "checkpoints" / "step_0000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
