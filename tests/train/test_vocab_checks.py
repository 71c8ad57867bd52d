"""Token ids that do not fit the model (issue 21): refused with one line naming the file and the
recipe key the vocabulary came from, at start from what meta.json records, or as batches are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe
from ncpctl.train.data import check_vocab as _check_vocab

from .conftest import ncpctl


def _data_copy(tiny_data: Path, tmp_path: Path) -> Path:
    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    return data


def test_the_vocabulary_message_names_the_keys_that_exist(make_recipe, tiny_data: Path, tmp_path: Path) -> None:
    """A 256-token tokenizer.vocab_size (model.vocab_size unset) with 512-token data: the message
    names tokenizer.vocab_size, not model.vocab_size."""
    r = load_recipe(make_recipe(), ["tokenizer.vocab_size=256"])
    ds = IndexedDataset(tiny_data / "train")
    with pytest.raises(UserError) as e:
        _check_vocab(r, ds, r.model_config.vocab_size)
    assert e.value.problems == [f"{tiny_data / 'meta.json'}: the data's tokenizer has 512 tokens but the model's "
                                "vocabulary has 256 (tokenizer.vocab_size 256; model.vocab_size is unset)"]
    assert "model.vocab_size" not in e.value.hint and "tokenizer.vocab_size" in e.value.hint
    r = load_recipe(make_recipe(), ["tokenizer.vocab_size=256", "model.vocab_size=256"])
    with pytest.raises(UserError, match=r"has 256 \(model.vocab_size\)") as e:
        _check_vocab(r, ds, r.model_config.vocab_size)
    assert e.value.hint.startswith("raise model.vocab_size")


def test_tokenize_records_each_splits_largest_id(make_recipe, tiny_data: Path, tmp_path: Path) -> None:
    meta = json.loads((tiny_data / "meta.json").read_text())
    for split in ("train", "val"):
        assert meta["splits"][split]["max_id"] == int(IndexedDataset(tiny_data / split).tokens.max())
    data = _data_copy(tiny_data, tmp_path)
    meta["splits"]["val"]["max_id"] = 700  # what the record says is believed at start: no scan
    (data / "meta.json").write_text(json.dumps(meta))
    r = load_recipe(make_recipe(), [f"data.train_prefix={data}/train", f"data.val_prefix={data}/val"])
    _check_vocab(r, IndexedDataset(data / "train"), 512)
    with pytest.raises(UserError, match="val.bin holds token id 700, outside the model's vocabulary of 512 ids"):
        _check_vocab(r, IndexedDataset(data / "val"), 512)


def test_out_of_range_ids_in_a_bin_stop_training_with_one_line(make_recipe, tiny_data: Path, tmp_path: Path) -> None:
    """A damaged train.bin (ids >= 512 that meta.json does not know of): exit 2 naming the file,
    not an IndexError in the embedding."""
    data = _data_copy(tiny_data, tmp_path)
    tokens = np.memmap(data / "train.bin", IndexedDataset(data / "train").dtype, "r+")
    tokens[5::9] = 600  # every window of 33 tokens holds some
    tokens.flush()
    del tokens
    r = ncpctl("pretrain", str(make_recipe()), "--set", f"data.train_prefix={data}/train",
               "--set", f"data.val_prefix={data}/val", "--set", "train.max_steps=2")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert errors[0].startswith(f"error: {data / 'train.bin'}: token id 600 at token ")
    assert errors[0].endswith("is outside the model's vocabulary of 512 ids (tokenizer.vocab_size 512; "
                              "model.vocab_size is unset)")
