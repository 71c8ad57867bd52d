"""``data.from_run`` (issue 46 item 9): another run's tokenized data in one key, instead of
``data.train_prefix``, ``data.val_prefix`` and ``tokenizer.path``; a resolved recipe (which records
all four) loads again; a directory without data and a contradicting key are one error each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe

from ..conftest import RECIPES, REPO

TOKENIZER = REPO / "tests" / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens


@pytest.fixture
def other_run(tmp_path: Path) -> Path:
    """A run directory as `ncpctl tokenize` leaves it: data/{train,val}.bin/.idx and tokenizer.json."""
    from ncpctl.data.indexed import IndexedDatasetWriter

    data = tmp_path / "other" / "data"
    data.mkdir(parents=True)
    for split in ("train", "val"):
        with IndexedDatasetWriter(data / split, "uint16") as w:
            w.add_document([5, 6, 7, 0])
    shutil.copy(TOKENIZER, data / "tokenizer.json")
    return tmp_path / "other"


def test_one_key_takes_another_runs_data(other_run: Path, tmp_path: Path) -> None:
    data = other_run / "data"
    for given in (other_run, data):  # the run directory, or its data/ directory
        r = load_recipe(RECIPES / "debug.yaml", [f"data.from_run={given}", f"run.dir={tmp_path / 'new'}"])
        assert (r.data.train_prefix, r.data.val_prefix) == (str(data / "train"), str(data / "val"))
        assert r.tokenizer.path == str(data / "tokenizer.json") and r.model_config.vocab_size == 320
    again = r.write_resolved(tmp_path / "resolved")  # records from_run and the three keys it set
    assert load_recipe(again).data.train_prefix == str(data / "train")


def test_no_data_there_or_a_contradicting_key_is_one_error(other_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        load_recipe(RECIPES / "debug.yaml", [f"data.from_run={tmp_path / 'empty'}"])
    assert len(e.value.problems) == 1 and "data.from_run" in e.value.problems[0]
    assert "no tokenized data there" in e.value.problems[0]
    with pytest.raises(UserError) as e:
        load_recipe(RECIPES / "debug.yaml", [f"data.from_run={other_run}", f"tokenizer.path={TOKENIZER}"])
    assert len(e.value.problems) == 1 and "sets tokenizer.path to" in e.value.problems[0]
