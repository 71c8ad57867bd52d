"""Concept labels through a weighted mixture (``data.mix`` + ``data.labels``; Steerling's labelled
mid-training mix): ``tokenize`` gives each component its own label file, aligned with its own
token stream, and the ``MixLoader`` hands every row the labels of the component it was drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.labels import LabelSpans, labels_path
from ncpctl.data.mix import MixLoader
from ncpctl.recipe import load_recipe

T = 16


def labelled_mix(root: Path) -> Path:
    """A recipe of two field-labelled components: every ``a`` document carries concept ``alpha`` on
    its first 40 characters, every ``b`` document ``beta`` on characters 10..60 (distinct per component)."""
    words = ("concept", "token", "block", "segment", "predict", "mean", "pool", "layer")
    for name, (concept, a, b) in {"a": ("alpha", 0, 40), "b": ("beta", 10, 60)}.items():
        docs = [{"text": " ".join(words[(i * 3 + j) % len(words)] + str(j % 7) for j in range(60)),
                 "concepts": [{"concept": concept, "start": a, "end": b}]} for i in range(12)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    p = root / "mix.yaml"
    p.write_text(f"run: {{dir: {root / 'run'}}}\ntokenizer: {{vocab_size: 300}}\n"
                 f"data:\n  val_fraction: 0.2\n  labels: field\n  mix:\n"
                 f"    - {{name: a, weight: 0.7, sources: ['{root}/a.jsonl']}}\n"
                 f"    - {{name: b, weight: 0.3, sources: ['{root}/b.jsonl']}}\n")
    return p


def test_each_row_carries_its_own_components_labels(tmp_path: Path) -> None:
    from ncpctl.data.tokenize import tokenize

    recipe = load_recipe(labelled_mix(tmp_path), need_sources=True)
    meta = tokenize(recipe)
    run = tmp_path / "run"
    assert meta["labels"]["vocabulary"] == ["alpha", "beta"]
    union = IndexedDataset(run / "data" / "train")
    whole = LabelSpans(run / "data" / "train", union.num_tokens, 2)
    parts, starts, first = [], [], 0
    for name in ("a", "b"):
        d = run / "mix" / name / "data"
        cmeta = json.loads((d / "meta.json").read_text())
        assert cmeta["labels"]["vocabulary"] == ["alpha", "beta"]  # one vocabulary: ids mean the same concept
        ds = IndexedDataset(d / "train")
        own = np.load(labels_path(d / "train"))
        assert own.shape[0] == cmeta["labels"]["spans"]["train"] > 0 and set(own[:, 2]) == {"ab".index(name)}
        parts.append((name, 0.7 if name == "a" else 0.3, ds, LabelSpans(d / "train", ds.num_tokens, 2)))
        starts.append(first)
        first += ds.num_tokens
    loader = MixLoader([p[:3] for p in parts], T, 8, seed=0, rank=1, world_size=2,
                       part_args=[{"labels": p[3]} for p in parts])
    seen = set()
    for _ in range(12):
        rows = next(loader)  # (4, T+1)
        ev = loader.last_labels()  # (4, T, 2)
        assert ev.shape == (4, T, 2)
        for r, (k, w) in enumerate(zip(loader.last_components, loader.last_ids)):
            k, off = int(k), int(w) * T
            # the row is component k's window w, and its labels are the union's at the same tokens
            assert np.array_equal(rows[r], np.asarray(union.tokens[starts[k] + off:starts[k] + off + T + 1]))
            assert np.array_equal(ev[r], whole.window(starts[k] + off, T))
            assert not ev[r, :, 1 - k].any()  # never the other component's concept
            seen.add((k, bool(ev[r, :, k].any())))
    assert {(0, True), (1, True)} <= seen  # both components drawn, with their labels
    # resumed from its state, the loader continues with the same rows and labels
    state = json.loads(json.dumps(loader.state_dict()))
    want = (next(loader), loader.last_labels())
    again = MixLoader([p[:3] for p in parts], T, 8, seed=0, rank=1, world_size=2,
                      part_args=[{"labels": p[3]} for p in parts])
    again.load_state_dict(state)
    assert np.array_equal(next(again), want[0]) and np.array_equal(again.last_labels(), want[1])


def test_a_components_labels_are_written_atomically_and_a_full_disk_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """``tokenize`` splitting a labelled union into data.mix components: the component's label file
    is replaced whole or not at all, and a full disk is a UserError (exit 2), as for its tokens."""
    import errno

    from ncpctl.data import mix
    from ncpctl.data.labels import labels_path
    from ncpctl.errors import UserError

    union, out = tmp_path / "union" / "train", tmp_path / "comp" / "train"
    union.parent.mkdir()
    out.parent.mkdir()
    np.save(labels_path(union), np.array([[0, 2, 1], [5, 7, 0], [9, 12, 1]], dtype=np.int64))
    assert mix._write_component_labels(union, out, 4, 10) == 2
    assert np.load(labels_path(out)).tolist() == [[1, 3, 0], [5, 8, 1]]  # shifted to the component's stream
    before = labels_path(out).read_bytes()

    real = np.save

    def full(f, arr, *a, **k):
        real(f, arr[:1])  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(UserError, match="space|full"):
        mix._write_component_labels(union, out, 0, 12)
    assert labels_path(out).read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == [labels_path(out).name]  # no temporary left
