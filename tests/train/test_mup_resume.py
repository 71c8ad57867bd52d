"""Decoupled muP in the real training loop: per-module lr groups are logged as the schedule
says, and a run killed inside a checkpoint write resumes bit for bit (the group names, lrs and
epsilons come back from the DeepSpeed checkpoint)."""

from __future__ import annotations

from .conftest import crash_and_resume, losses, same_weights

MUP = ["--set", "model.mup_base_width=32", "--set", "train.max_steps=6", "--set", "train.eval_every=6"]


def test_mup_resume_is_bit_identical(make_recipe) -> None:
    ref, crash = crash_and_resume(make_recipe, "mup", MUP)
    assert losses(crash) == losses(ref)
    assert same_weights(ref, crash, 6)
