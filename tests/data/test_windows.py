"""ncpctl.data.windows: window layout, epoch order, data-parallel sharding, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
from ncpctl.data.windows import WindowLoader, epoch_order
from ncpctl.errors import UserError

T = 4


def make_dataset(tmp_path: Path, num_tokens: int, name: str = "c") -> IndexedDataset:
    """Tokens 0..num_tokens-1 (int32), split into a few documents: a window's id is row[0] // T."""
    lengths = np.full(num_tokens // 7, 7)
    lengths = np.append(lengths, num_tokens - lengths.sum())
    with IndexedDatasetWriter(tmp_path / name, np.int32) as w:
        w.add_documents(np.arange(num_tokens), lengths)
    return IndexedDataset(tmp_path / name)


def take(loader: WindowLoader, steps: int) -> list[np.ndarray]:
    return [next(loader) for _ in range(steps)]


def test_windows_overlap_by_one_and_cover_an_epoch(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 4 * T + 1 + 3)  # 20 tokens: 4 windows, 3 tail tokens unused
    loader = WindowLoader(ds, seq_len=T, global_batch_size=2, seed=0)
    assert loader.num_windows == 4
    rows = np.concatenate(take(loader, 2))
    assert rows.dtype == np.int64 and rows.shape == (4, T + 1)
    ids = rows[:, 0] // T
    assert sorted(ids.tolist()) == [0, 1, 2, 3]  # each window exactly once per epoch
    for i, row in zip(ids, rows):
        assert row.tolist() == list(range(i * T, i * T + T + 1))  # inputs row[:-1], targets row[1:]
    assert (loader.epoch, loader.position) == (1, 0)


def test_too_few_tokens(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, T)
    with pytest.raises(UserError, match=rf"c\.bin: dataset has {T} tokens, fewer than one window of seq_len\+1 = {T + 1}"):
        WindowLoader(ds, seq_len=T, global_batch_size=1, seed=0)
    assert WindowLoader(make_dataset(tmp_path, T + 1, "d"), seq_len=T, global_batch_size=1, seed=0).num_windows == 1


def test_order_is_pinned() -> None:
    # The data order must not change across machines or numpy upgrades: raw PCG64 + SeedSequence.
    assert epoch_order(10, 1234, 0).tolist() == [5, 6, 3, 9, 7, 4, 1, 2, 8, 0]
    assert epoch_order(10, 1234, 1).tolist() == [9, 2, 0, 7, 6, 1, 8, 4, 5, 3]
    assert sorted(epoch_order(1000, 7, 3).tolist()) == list(range(1000))


def test_deterministic_per_seed(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 200)
    a = take(WindowLoader(ds, T, 8, seed=1), 5)
    b = take(WindowLoader(ds, T, 8, seed=1), 5)
    c = take(WindowLoader(ds, T, 8, seed=2), 5)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not all((x == y).all() for x, y in zip(a, c))


@pytest.mark.parametrize("world_size", [2, 3, 6])
def test_ranks_partition_the_global_batch(tmp_path: Path, world_size: int) -> None:
    ds = make_dataset(tmp_path, 23 * T + 1)  # 23 windows: batches of 6 straddle epoch boundaries
    steps = 9
    single = take(WindowLoader(ds, T, 6, seed=3), steps)
    ranks = [take(WindowLoader(ds, T, 6, seed=3, rank=r, world_size=world_size), steps) for r in range(world_size)]
    for s in range(steps):
        assert ranks[0][s].shape == (6 // world_size, T + 1)
        assert (np.concatenate([ranks[r][s] for r in range(world_size)]) == single[s]).all()


def test_global_batch_must_divide(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 100)
    with pytest.raises(UserError, match="global_batch_size 6 is not divisible by the world size 4"):
        WindowLoader(ds, T, 6, seed=0, rank=0, world_size=4)


@pytest.mark.parametrize("stop", [1, 3, 4, 7])
def test_resume_matches_uninterrupted(tmp_path: Path, stop: int) -> None:
    ds = make_dataset(tmp_path, 10 * T + 1)  # 10 windows, batch 4: epochs end mid-batch
    full = take(WindowLoader(ds, T, 4, seed=5), 12)
    first = WindowLoader(ds, T, 4, seed=5)
    take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = WindowLoader(ds, T, 4, seed=5, rank=1, world_size=2)  # resume on another world size
    resumed.load_state_dict(state)
    for s in range(stop, 12):
        assert (next(resumed) == full[s][2:4]).all()
    assert resumed.epoch >= 3  # crossed several epoch boundaries after resuming


def test_batch_larger_than_epoch(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 3 * T + 1)  # 3 windows, batch 7 spans three epochs
    rows = next(WindowLoader(ds, T, 7, seed=0))
    ids = (rows[:, 0] // T).tolist()
    assert sorted(ids[:3]) == sorted(ids[3:6]) == [0, 1, 2]


def test_load_state_dict_rejects_mismatches(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 100)
    state = WindowLoader(ds, T, 4, seed=5).state_dict()
    with pytest.raises(UserError) as e:
        WindowLoader(make_dataset(tmp_path, 101, "other"), T + 1, 4, seed=5).load_state_dict(state, "ckpt/step-10")
    assert e.value.problems == [
        "ckpt/step-10: data loader seq_len is 4 in the checkpoint but 5 now",
        "ckpt/step-10: data loader num_tokens is 100 in the checkpoint but 101 now",
    ]
    with pytest.raises(UserError, match="outside the 24 windows"):
        WindowLoader(ds, T, 4, seed=5).load_state_dict({**state, "position": 24})
    with pytest.raises(UserError, match="lacks epoch"):
        WindowLoader(ds, T, 4, seed=5).load_state_dict({k: v for k, v in state.items() if k != "epoch"})


def test_sample_ids_are_global_and_independent_of_the_world_size(tmp_path: Path) -> None:
    """The global sample index of each row (DLCM's boundary-noise key): step s, global row i is
    s * G + i on one rank or many, and it continues after a resume."""
    ds = make_dataset(tmp_path, 23 * T + 1)
    single = WindowLoader(ds, T, 6, seed=3)
    ranks = [WindowLoader(ds, T, 6, seed=3, rank=r, world_size=3) for r in range(3)]
    for s in range(9):  # batches straddle epoch boundaries
        next(single)
        assert single.sample_ids().tolist() == list(range(6 * s, 6 * s + 6))
        for loader in ranks:
            next(loader)
        assert np.concatenate([loader.sample_ids() for loader in ranks]).tolist() == single.sample_ids().tolist()
    resumed = WindowLoader(ds, T, 6, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(single.state_dict())))
    next(resumed)
    assert resumed.sample_ids().tolist() == [57, 58, 59]


def test_source_map_names_each_tokens_source(tmp_path: Path) -> None:
    """SourceMap against a per-token reference: each sequence's source repeated over its tokens."""
    from ncpctl.data.windows import SourceMap

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40, size=23)
    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as w:
        for n in sizes:
            w.add_document(rng.integers(0, 100, size=int(n)))
    ds = IndexedDataset(tmp_path / "s")
    counts = [5, 0, 11, 7]  # an empty source in between
    smap = SourceMap(ds, counts, ["a", "b", "c", "d"])
    ref = np.repeat(np.repeat(np.arange(4), counts), sizes)  # (num_tokens,)
    assert (smap.sources(np.arange(ds.num_tokens)) == ref).all()
    for i, (a, b) in enumerate(smap.ranges()):  # each source's tokens, contiguous
        assert (ref[a:b] == i).all() and (b - a) == (ref == i).sum()
    loader = WindowLoader(ds, 16, 4, seed=3, sources=smap)
    for _ in range(5):
        next(loader)
        want = ref[loader.last_ids[:, None] * 16 + np.arange(16)]
        assert (loader.last_sources() == want).all()
    with pytest.raises(ValueError, match="does not fit"):
        SourceMap(ds, [5, 0, 11, 6], ["a", "b", "c", "d"])


def test_every_batch_is_checked_against_the_vocabulary(tmp_path: Path) -> None:
    """Issue 21: ids at or above the vocabulary (or negative) are refused as batches are read,
    naming the file, the id and its token offset (here each token's id is its offset)."""
    ds = make_dataset(tmp_path, 10 * T + 1)  # ids 0..40, 10 windows
    loader = WindowLoader(ds, seq_len=T, global_batch_size=1, seed=0, vocab_size=25, vocab_from="model.vocab_size")
    seen = []
    with pytest.raises(UserError) as e:
        for _ in range(10):
            seen.append(int(next(loader)[0, 0]) // T)
    first_bad = next(int(i) for i in epoch_order(10, 0, 0) if i * T + T >= 25)
    top = first_bad * T + T  # the window's largest id, at its own offset
    assert e.value.problems == [f"{ds.bin_path}: token id {top} at token {top:,} is outside the model's vocabulary "
                                "of 25 ids (model.vocab_size)"]
    assert all(i * T + T < 25 for i in seen)  # the windows before it were fine and were read
    with IndexedDatasetWriter(tmp_path / "neg", np.int32) as w:
        w.add_documents(np.array([1, 2, 3, 7, 4, 5, 6, 0, 1]), np.array([9]))
    np.memmap(tmp_path / "neg.bin", np.int32, "r+")[3] = -7  # a damaged int32 .bin (the writer refuses it)
    with pytest.raises(UserError, match="token id -7 at token 3 is outside"):
        next(WindowLoader(IndexedDataset(tmp_path / "neg"), seq_len=8, global_batch_size=1, seed=0, vocab_size=9))


def test_documents_of_each_window_come_from_the_index(tmp_path: Path) -> None:
    """data.document_mask: token v of make_dataset is in document v // 7 (7-token documents), so
    each input token's document index, counted from 0 in its row, is v // 7 - row[0] // 7; a data.mix
    row reads its own component's index."""
    from ncpctl.data.mix import MixLoader

    ds = make_dataset(tmp_path, 200)
    loader = WindowLoader(ds, seq_len=9, global_batch_size=6, seed=2)
    assert loader.last_documents() is None
    for _ in range(3):
        rows = next(loader)[:, :-1]  # (B, T) inputs
        assert np.array_equal(loader.last_documents(), rows // 7 - rows[:, :1] // 7)
    with IndexedDatasetWriter(tmp_path / "fives", np.uint16) as w:  # another layout: 5-token documents, uint16
        w.add_documents(np.arange(60) % 50, np.full(12, 5))
    mix = MixLoader([("sevens", 1.0, ds), ("fives", 1.0, IndexedDataset(tmp_path / "fives"))], 9, 4, seed=0)
    for _ in range(3):
        next(mix)
        docs = mix.last_documents()
        for row, k, i in zip(docs, mix.last_components, mix.last_ids):
            offsets = np.arange(i * 9, i * 9 + 9)
            size = 7 if k == 0 else 5
            assert np.array_equal(row, offsets // size - offsets[0] // size)
