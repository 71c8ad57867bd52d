"""ncpctl.data.mix: Megatron's blend (each component within one sample of its share over every
prefix), per-component epochs, data-parallel sharding, exact resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
from ncpctl.data.mix import MixLoader, blend, blending_indices, check_tokenizers
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe

T = 4
STRIDE = 100_000  # component k's tokens are k*STRIDE + 0..n-1: a row says where it came from


def component(tmp_path: Path, k: int, num_tokens: int) -> IndexedDataset:
    with IndexedDatasetWriter(tmp_path / f"c{k}", np.int32) as w:
        w.add_documents(k * STRIDE + np.arange(num_tokens), np.array([num_tokens]))
    return IndexedDataset(tmp_path / f"c{k}")


def mixture(tmp_path: Path, weights=(0.5, 0.3, 0.2), sizes=(41, 29, 53)) -> list:
    return [(f"c{k}", w, component(tmp_path, k, n)) for k, (w, n) in enumerate(zip(weights, sizes))]


def test_every_prefix_of_10k_samples_holds_each_share_within_one_sample() -> None:
    w = np.array([0.5, 0.3, 0.2])
    index, sample = blending_indices([5.0, 3.0, 2.0], 10_000)  # unnormalised weights: the same blend
    counts = np.cumsum(np.eye(3, dtype=np.int64)[index], axis=0)  # (10k, 3) samples of each so far
    n = np.arange(1, 10_001)[:, None]
    assert np.abs(counts - w * n).max() < 1.0
    # Megatron's dataset_sample_index: the k-th draw of a component is its sample k
    for k in range(3):
        assert sample[index == k].tolist() == list(range(int((index == k).sum())))
    # incremental blending (the loader's, batch by batch) is the same sequence
    c = [0, 0, 0]
    parts = [blend(list(w), c, s, 37) for s in range(0, 37 * 40, 37)]
    assert np.concatenate(parts).tolist() == index[:37 * 40].tolist()


def test_rows_follow_the_blend_and_each_component_wraps_its_own_epochs(tmp_path: Path) -> None:
    parts = mixture(tmp_path)
    loader = MixLoader(parts, T, 8, seed=3)
    rows = np.concatenate([next(loader) for _ in range(50)])  # 400 samples
    comp = rows[:, 0] // STRIDE
    assert comp.tolist() == blending_indices([0.5, 0.3, 0.2], 400)[0].tolist()
    for k, (_, _, ds) in enumerate(parts):
        ids = (rows[comp == k, 0] % STRIDE) // T  # window ids of component k, in draw order
        nw = (ds.num_tokens - 1) // T
        for e in range(len(ids) // nw):  # every full epoch visits each window once
            assert sorted(ids[e * nw:(e + 1) * nw].tolist()) == list(range(nw))
        first = rows[comp == k][0]
        assert first.tolist() == list(range(first[0], first[0] + T + 1))  # whole windows of that component
    assert loader.state_dict()["counts"] == np.bincount(comp, minlength=3).tolist()


def test_ranks_split_each_global_batch_and_resume_continues_exactly(tmp_path: Path) -> None:
    parts = mixture(tmp_path)
    one = MixLoader(parts, T, 6, seed=1)
    whole = [next(one) for _ in range(12)]
    halves = [MixLoader(parts, T, 6, seed=1, rank=r, world_size=2) for r in range(2)]
    for step in range(12):
        got = np.concatenate([next(h) for h in halves])
        assert np.array_equal(got, whole[step])
    assert halves[1].sample_ids().tolist() == list(range(69, 72))  # global sample indices of rank 1's rows

    first = MixLoader(parts, T, 6, seed=1)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint's ncpctl.json stores it
    resumed = MixLoader(parts, T, 6, seed=1, rank=1, world_size=3)  # resumed on another world size
    resumed.load_state_dict(state)
    for step in range(5, 12):
        assert np.array_equal(next(resumed), whole[step][2:4])  # rank 1 of 3: rows 2..3


def test_resume_refuses_another_mixture(tmp_path: Path) -> None:
    parts = mixture(tmp_path)
    a = MixLoader(parts, T, 4, seed=0)
    next(a)
    other = MixLoader([(n, w if n != "c2" else 0.4, ds) for n, w, ds in parts], T, 4, seed=0)
    with pytest.raises(UserError, match="data loader components is"):
        other.load_state_dict(a.state_dict(), source="ckpt")
    with pytest.raises(UserError, match="trained on one dataset"):
        other.load_state_dict({"version": 1, "epoch": 0, "position": 0})


def test_components_must_share_one_tokenizer(tmp_path: Path) -> None:
    parts = []
    for k, sha in enumerate(["aaaa", "aaaa", "bbbb"]):
        d = tmp_path / f"d{k}"
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"tokenizer": {"sha256": sha}}))
        parts.append((f"c{k}", 1.0, component(d, k, 20)))
    check_tokenizers(parts[:2])
    with pytest.raises(UserError, match="component 'c2' was tokenized with another tokenizer than 'c0'"):
        check_tokenizers(parts)


@pytest.mark.parametrize("mix, message", [
    ("[{name: a, weight: -1, prefix: /x}]", "data.mix[0].weight: Input should be greater than 0, got -1"),
    ("[{name: a, weight: 0, prefix: /x}, {name: b, weight: 0, prefix: /y}]", "greater than 0, got 0"),
    ("[{name: a, weight: .inf, prefix: /x}]", "data.mix[0].weight: Input should be a finite number"),
    ("[{name: a, weight: 1, prefix: /x}, {name: a, weight: 1, prefix: /y}]", "names must be unique (a repeated)"),
    ("[{name: a, weight: 1}]", "give exactly one of `prefix` or `sources`"),
    ("[{name: a/b, weight: 1, prefix: /x}]", "data.mix[0].name: String should match pattern"),
    ("[{name: a, weight: 1, prefix: /x}]\n  sources: [a.txt]", "give data.sources or data.mix, not both"),
])
def test_bad_mixtures_are_one_line_errors(tmp_path: Path, mix: str, message: str) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata:\n  mix: {mix}\n")
    with pytest.raises(UserError) as e:
        load_recipe(p)
    lines = [line for line in e.value.problems if "mix" in line]  # one per bad component (weights 0, 0: two)
    assert lines and all("\n" not in line for line in lines) and message in lines[0], e.value.problems
    assert len(lines) == (2 if "weight: 0" in mix else 1)


def test_tokenize_writes_a_prefix_per_component(tmp_path: Path, text_corpus: Path) -> None:
    from ncpctl.data.tokenize import tokenize

    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ntokenizer: {{vocab_size: 300}}\ndata:\n  val_fraction: 0.2\n  mix:\n"
                 f"    - {{name: a, weight: 2, sources: ['{text_corpus}/doc0*.txt']}}\n"
                 f"    - {{name: b, weight: 1, sources: ['{text_corpus}/doc1*.txt', '{text_corpus}/doc2*.txt']}}\n")
    recipe = load_recipe(p, need_sources=True)
    meta = tokenize(recipe)
    run = tmp_path / "run"
    for split in ("train", "val"):
        union = IndexedDataset(run / "data" / split)
        parts = [IndexedDataset(run / "mix" / name / "data" / split) for name in ("a", "b")]
        # the components are the union's documents, source by source: a's 10 files, then b's 14
        assert np.array_equal(np.concatenate([np.asarray(d.tokens) for d in parts]), np.asarray(union.tokens))
        assert sum(len(d) for d in parts) == len(union)
    assert len(IndexedDataset(run / "mix" / "a" / "data" / "train")) + len(IndexedDataset(run / "mix" / "a" / "data" / "val")) == 10
    sha = {json.loads((run / "mix" / n / "data" / "meta.json").read_text())["tokenizer"]["sha256"] for n in "ab"}
    assert sha == {meta["tokenizer"]["sha256"]}
    stamp = (run / "mix" / "a" / "data" / "train.bin").stat().st_mtime_ns
    again = tokenize(recipe)
    assert again["up_to_date"] and again["mix"] == meta["mix"]
    assert (run / "mix" / "a" / "data" / "train.bin").stat().st_mtime_ns == stamp  # nothing rewritten
