"""The per-step hook for global statistics (NCPModel.stat_keys / on_step_end): a toy design
(tests/model/toys.py::CountingSegmenter, named in the recipe by import path, so the real CLI
and every launcher rank load it) reports local sums from each forward; one process with 4
accumulation steps and two ranks with 2 each must hand every rank's hook the same global
totals (the same 8 windows per step: the loader shards one global batch), and log them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO

from .conftest import metrics, ncpctl, result

SETS = ["--set", "train.max_steps=3", "--set", "train.micro_batch_size=2", "--set", "train.eval_every=0",
        "--set", "train.save_every=0", "--set", "model.concept.segmentation=tests.model.toys:CountingSegmenter"]


def _hooked(path: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(x) for x in Path(f"{path}.{r}").read_text().splitlines()] for r in range(ranks)]


@pytest.mark.slow
def test_one_rank_and_two_ranks_see_the_same_global_statistics(make_recipe, tmp_path) -> None:
    runs = {}
    for name, ranks in (("one", 0), ("two", 2)):
        env = {"PYTHONPATH": str(REPO), "NCP_TOY_STATS": str(tmp_path / f"{name}.stats")}
        r = result(ncpctl("pretrain", str(make_recipe(name)), "--json", *SETS, env=env, launcher_ranks=ranks,
                          timeout=600))
        assert r["world_size"] == max(1, ranks)
        runs[name] = (_hooked(tmp_path / f"{name}.stats", max(1, ranks)), metrics(tmp_path / name))
    (one_hook, one_log), (two_hook, two_log) = runs["one"], runs["two"]
    assert len(one_hook[0]) == 3 and two_hook[0] == two_hook[1]  # every rank's hook, every step, the same
    # seq_len 32, k 4: each step's global batch of 8 windows holds 256 tokens and 64 concepts
    for a, b, la, lb in zip(one_hook[0], two_hook[0], one_log, two_log):
        assert a["toy_tokens"] == b["toy_tokens"] == 8 * 32 and a["toy_concepts"] == b["toy_concepts"] == 8 * 8
        assert abs(a["toy_c0_sum"] - b["toy_c0_sum"]) <= 1e-4 * max(1.0, abs(a["toy_c0_sum"]))
        assert la["toy_tokens"] == a["toy_tokens"] and lb["toy_c0_sum"] == b["toy_c0_sum"]  # and logged
