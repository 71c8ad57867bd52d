"""A dataset's meta.json is read through one checked reader (``ncpctl.data.meta``; issue 42 item
6): a file that is not a JSON object, or whose fields have other types, is one line naming the
file (and the key), exit 2, for a single dataset and for a ``data.mix`` component alike, where it
was a ``TypeError`` / ``AttributeError`` inside a check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data import meta
from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
from ncpctl.data.mix import check_tokenizers
from ncpctl.errors import UserError


@pytest.mark.parametrize("text, message", [
    ("[]", "not a JSON object (a list)"),
    ('"x"', "not a JSON object (a string)"),
    ("null", "not a JSON object (null)"),
    ("{", "unreadable"),
    ('{"tokenizer": []}', "tokenizer: Input should be a valid dictionary"),
    ('{"tokenizer": {"vocab_size": "512"}}', "tokenizer.vocab_size: Input should be a valid integer"),
    ('{"splits": {"val": {"documents_per_source": [1, "2"]}}}', "splits.val.documents_per_source.1"),
    ('{"labels": {"vocabulary": "abc"}}', "labels.vocabulary: Input should be a valid list"),
])
def test_a_meta_json_of_the_wrong_shape_is_one_line_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "meta.json"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        meta.read(path)
    (line,) = e.value.problems
    assert line.startswith(f"{path}: ") and message in line and "\n" not in line, line


def test_a_meta_json_that_tokenize_writes_passes(tmp_path: Path) -> None:
    good = {"tokenizer": {"sha256": "ab", "vocab_size": 512, "eod_id": 0, "special_tokens": {"<|mask|>": 1}},
            "splits": {"val": {"documents": 7, "tokens": 9, "max_id": 511, "documents_per_source": [7]}},
            "source_labels": ["a"], "labels": {"vocabulary": ["x"], "document_level": [], "labeller": "field"},
            "anything": {"else": [1]}}
    (tmp_path / "meta.json").write_text(json.dumps(good))
    assert meta.read(tmp_path / "meta.json") == good
    assert meta.read(tmp_path / "absent.json") is None


def _component(d: Path, meta_text: str | None) -> IndexedDataset:
    d.mkdir()
    with IndexedDatasetWriter(d / "train", np.int32) as w:
        w.add_documents(np.arange(40), np.array([40]))
    if meta_text is not None:
        (d / "meta.json").write_text(meta_text)
    return IndexedDataset(d / "train")


@pytest.mark.parametrize("bad", ["[1, 2]", '"tokenizer"', '{"tokenizer": "sha"}'])
def test_a_mix_component_whose_meta_json_is_not_an_object_is_one_line(tmp_path: Path, bad: str) -> None:
    """The tester's first case: ``check_tokenizers`` called ``.get`` on whatever the file held."""
    parts = [("a", 1.0, _component(tmp_path / "a", '{"tokenizer": {"sha256": "ab"}}')),
             ("b", 1.0, _component(tmp_path / "b", bad))]
    with pytest.raises(UserError) as e:
        check_tokenizers(parts)
    (line,) = e.value.problems
    assert line.startswith(str(tmp_path / "b" / "meta.json")), line


def test_a_single_datasets_meta_json_of_brackets_stops_pretrain_in_one_line(tiny_data_copy: Path,
                                                                            tmp_path: Path) -> None:
    """The tester's second case, through what pretrain runs first (``open_data``: the vocabulary
    check indexed ``meta["tokenizer"]`` of a list)."""
    from ncpctl.recipe import load_recipe
    from ncpctl.train.data import open_data
    from ncpctl.train.hooks import Hooks

    (tiny_data_copy / "meta.json").write_text("[]")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata: {{train_prefix: {tiny_data_copy / 'train'}, "
                      f"val_prefix: {tiny_data_copy / 'val'}}}\ntokenizer: {{vocab_size: 512}}\n"
                      "model: {size: debug}\ntrain: {max_steps: 2, micro_batch_size: 2, seq_len: 32}\n")
    r = load_recipe(recipe)
    with pytest.raises(UserError) as e:
        open_data(r, 0, 1, Hooks(r), lambda m: None)
    assert e.value.problems == [f"{tiny_data_copy / 'meta.json'}: not a JSON object (a list): not the meta.json "
                                "of a dataset"]


@pytest.fixture
def tiny_data_copy(tmp_path: Path) -> Path:
    """A small tokenized dataset (train/val, 512-token ids, meta.json) of our own to damage."""
    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        with IndexedDatasetWriter(d / split, np.uint16) as w:
            w.add_documents(rng.integers(0, 512, 4000), np.array([1000] * 4))
    (d / "meta.json").write_text(json.dumps({"tokenizer": {"vocab_size": 512}}))
    return d


def test_tokenize_rebuilds_over_a_damaged_meta_json(tiny_data_copy: Path) -> None:
    """Tokenize's own up-to-date check reads the meta.json it wrote: a damaged one means "tokenize
    again", not an AttributeError."""
    from ncpctl.data.tokenize import _sha256, _up_to_date

    d = tiny_data_copy
    (d / "tokenizer.json").write_text("{}")
    sha = _sha256(d / "tokenizer.json")
    for text in ("[]", '{"fingerprint": "f", "tokenizer": []}',
                 json.dumps({"fingerprint": "f", "tokenizer": {"sha256": sha}, "splits": []}),
                 json.dumps({"fingerprint": "f", "tokenizer": {"sha256": sha}, "splits": {"train": 5}})):
        (d / "meta.json").write_text(text)
        assert _up_to_date(d, "f") is None, text
