"""DLCM in the real training loop resumes bit for bit: a run killed inside a checkpoint write
continues from the last complete checkpoint with the same sampled boundaries (noise keyed by
the global sample index) and the same Global Parser state (the previous step's global F, the
``rate_counts`` buffer saved with the weights), so its losses, boundary statistics and final
weights equal an uninterrupted run's."""

from __future__ import annotations

from .conftest import crash_and_resume, metrics, same_weights

DLCM = ["--set", "model.concept.segmentation=dynamic", "--set", "model.concept.coupling=cross_attention",
        "--set", "model.concept.ncp_weight=0", "--set", "model.concept.vq_weight=0",
        "--set", "train.max_steps=6", "--set", "train.eval_every=6"]
KEYS = ("loss", "balance_loss", "boundary_rate", "boundary_prob", "boundaries")


def test_dlcm_resume_is_bit_identical(make_recipe) -> None:
    ref_dir, crash_dir = crash_and_resume(make_recipe, "dlcm", DLCM)
    ref, got = {m["step"]: m for m in metrics(ref_dir)}, metrics(crash_dir)
    for m in got:  # the killed run's steps 1-6 and the resumed run's 4-6
        assert all(m[k] == ref[m["step"]][k] for k in KEYS), (m["step"], {k: (m[k], ref[m["step"]][k]) for k in KEYS})
    assert [m["step"] for m in got if m["step"] > 3][-3:] == [4, 5, 6]
    assert any(m["balance_loss"] != 0 for m in got)  # F is the previous step's from step 2 on
    assert same_weights(ref_dir, crash_dir, 6)
