"""DLCM's Global Parser through the real entry point: one process with 4 accumulation steps,
one with none (micro-batch 8) and two ranks with 2 each train on the same global batches, so
(boundary noise keyed by the global sample index, F and G global over ranks and micro-steps)
they log the same boundary rate F, mean probability G, balance loss and loss at every step; and
so do two ranks at ZeRO-3 (parameters partitioned and gathered around each module, the segmenter
and the cross-attention coupling included)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO

from .conftest import metrics, ncpctl, result

SETS = ["--set", "train.max_steps=3", "--set", "train.eval_every=0", "--set", "train.save_every=0",
        "--set", "model.concept.segmentation=dynamic", "--set", "model.concept.ncp_weight=0",
        "--set", "model.concept.vq_weight=0"]
# (the logged tokens_per_concept is the mean of each micro-batch's ratio, so it depends on the
# micro-batch size; the global one is boundary_tokens / boundaries of the step statistics)
KEYS = ("boundary_rate", "boundary_prob", "balance_loss", "loss", "boundaries", "boundary_tokens")


@pytest.mark.slow
def test_one_rank_two_ranks_and_no_accumulation_agree(make_recipe) -> None:
    logs = {}
    for name, ranks, micro, zero in (("accum", 0, 2, 0), ("two", 2, 2, 0), ("whole", 0, 8, 0), ("zero3", 2, 2, 3)):
        r = result(ncpctl("pretrain", str(make_recipe(name)), "--json", *SETS,
                          "--set", f"train.micro_batch_size={micro}", "--set", f"deepspeed.zero_stage={zero}",
                          "--set", "model.concept.coupling=cross_attention", env={"PYTHONPATH": str(REPO)},
                          launcher_ranks=ranks, timeout=600))
        assert r["world_size"] == max(1, ranks) and r["zero_stage"] == zero
        logs[name] = metrics(make_recipe(name).parent / name)
    for step in range(3):
        ref = logs["accum"][step]
        assert 0 < ref["boundary_rate"] < 1 and ref["boundaries"] > 0  # stats logged too
        for other in ("two", "whole", "zero3"):
            got = logs[other][step]
            for k in KEYS:
                assert abs(got[k] - ref[k]) <= 1e-5 * max(1.0, abs(ref[k])), (other, step, k, got[k], ref[k])
