"""data.mix through the real ``ncpctl pretrain``: killed (SIGKILL) inside a checkpoint write and
resumed, a mixture run continues the same sample sequence (the same losses, bit for bit), and
validation logs each component's loss."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import crash_and_resume, losses, metrics


def test_mixture_resumes_after_kill9_to_the_same_sequence(make_recipe, tiny_data: Path) -> None:
    mix = (f"[{{name: a, weight: 0.6, prefix: {tiny_data}/train, val_prefix: {tiny_data}/val}}, "
           f"{{name: b, weight: 0.4, prefix: {tiny_data}/val}}]")  # b: another dataset of the same tokenizer
    sets = ["--set", "train.max_steps=6", "--set", "data.train_prefix=null", "--set", f"data.mix={mix}"]
    ref, crash = crash_and_resume(make_recipe, "mix", sets)
    assert losses(crash) == losses(ref) and len(losses(ref)) == 6  # exact, step by step
    val = metrics(ref, "val")[-1]
    assert val["loss/a"] == val["loss"] and "loss/b" not in val  # b has no validation split of its own
    state = json.loads((crash / "checkpoints" / "step_0000006" / "ncpctl.json").read_text())["data"]["train"]
    assert state["kind"] == "mix" and state["sample"] == 6 * 8 and sum(state["counts"]) == 48
    assert state["counts"][0] in (28, 29)  # 0.6 of 48 = 28.8, within one sample


def test_a_prefix_mixture_finds_its_tokenizer_beside_its_first_component(tmp_path: Path) -> None:
    from ncpctl.recipe import load_recipe
    from ncpctl.train.checkpoint import tokenizer_file

    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata:\n  mix: [{{name: a, weight: 1, prefix: {tmp_path}/d/a}}, "
                 f"{{name: b, weight: 1, prefix: {tmp_path}/e/b}}]\n")
    assert tokenizer_file(load_recipe(p)) == tmp_path / "d" / "tokenizer.json"


def test_the_unigram_entropy_of_a_mixture_is_that_of_its_weighted_unigrams() -> None:
    import numpy as np

    from ncpctl.train.metrics import unigram_entropy

    a, b = np.zeros(100, dtype=np.int64), np.ones(10, dtype=np.int64)  # one token each, 100 vs 10 of them
    assert unigram_entropy([(0.5, a), (0.5, b)], 4) == np.log(2)  # by weight, not by size
    assert unigram_entropy([(1.0, a)], 4) == 0.0
