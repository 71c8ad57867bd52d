"""Weighted data mixtures (``data.mix``): Megatron-LM's and GPT-NeoX's blend, one resumable loader.

Weights are normalised to ``w``. Global sample ``i`` (counted over the whole run, as
``WindowLoader``'s) is drawn from the component that is most under-served so far::

    k(i) = argmax_k  w_k * (i + 1) - n_k(i)        (first k on ties; n_k(i): k's samples before i)

which is Megatron's ``build_blending_indices``: the sequence depends only on the weights, and every
prefix of it holds each component's share to within one sample. The ``n_k(i)``-th sample of
component k is its window ``epoch_order(num_windows_k, seed, e, stream=k)[n mod num_windows_k]``,
``e = n // num_windows_k``: each component has its own shuffled order and wraps its epochs on
its own. The loader's state is the global sample index and the counts ``n_k`` (the greedy rule
needs nothing else), so a resumed loader continues the exact sequence without replaying it; like
``WindowLoader`` it does not depend on the rank or the world size, and rank r of a world of size R
takes rows ``r*B : (r+1)*B`` of every global batch. numpy only (no torch).

What a design reads beside the tokens (Steerling's concept labels, ``PREFIX.labels.npy``) is each
component's own (``part_args``: its ``WindowLoader`` arguments, e.g. its ``LabelSpans``): a row's
labels are read from its component's label file at its component's window, so they stay aligned
with its tokens, and they follow the blend (hence resume and rank) like the tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter, paths
from ncpctl.data.labels import labels_path
from ncpctl.data.meta import check as check_meta, read as read_meta
from ncpctl.data.windows import WindowLoader
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, atomic_write_with

STATE_VERSION = 1
_RESUME_HINT = ("resume with the same data.mix (names, weights, datasets), train.seq_len, train.global_batch_size "
                "and train.seed as the checkpoint, or start a fresh run (train.resume: never)")


def normalised(weights: list[float]) -> list[float]:
    """``weights`` / their sum. Weights whose sum is subnormal (5e-324 each) or overflows (1e308 each)
    are scaled by their largest first, so that the result still sums to 1."""
    total = float(sum(weights))
    if not sys.float_info.min <= total < math.inf:
        top = max(float(w) for w in weights)
        weights = [float(w) / top for w in weights]
        total = float(sum(weights))
    return [float(w) / total for w in weights]


def blend(weights: list[float], counts: list[int], start: int, n: int) -> np.ndarray:
    """Components of global samples ``start .. start+n-1`` ``(n,)`` int64, given each component's
    samples before ``start`` in ``counts`` (updated in place). ``weights`` normalised."""
    out = np.empty(n, dtype=np.int64)
    K = range(len(weights))
    for j in range(n):
        i = start + j
        # plain floats: the same IEEE products on every platform, hence the same order
        k = max(K, key=lambda k: weights[k] * (i + 1) - counts[k])  # max() keeps the first on ties, as np.argmax
        counts[k] += 1
        out[j] = k
    return out


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``(dataset_index, dataset_sample_index)`` for global samples ``0 .. size-1``: which
    component each is from and how many of that component's samples came before it, each ``(size,)``."""
    counts = [0] * len(weights)
    index = blend(normalised(weights), counts, 0, size)
    sample = np.empty(size, dtype=np.int64)
    for k in range(len(weights)):
        where = np.flatnonzero(index == k)
        sample[where] = np.arange(where.size)
    return index, sample


class MixLoader:
    """``WindowLoader``'s interface over a weighted mixture: batches ``(global_batch_size //
    world_size, seq_len + 1)`` int64, ``sample_ids``, ``state_dict`` / ``load_state_dict``.
    ``parts``: ``(name, weight, dataset)`` per component, in ``data.mix`` order."""

    def __init__(self, parts: list[tuple[str, float, IndexedDataset]], seq_len: int, global_batch_size: int,
                 seed: int, rank: int = 0, world_size: int = 1, vocab_size: int | None = None, vocab_from: str = "",
                 part_args: list[dict[str, Any]] | None = None):
        if not parts:
            raise ValueError("a mixture needs at least one component")
        args = part_args or [{} for _ in parts]  # each component's own labels (ncpctl.data.labels.LabelSpans)
        # one single-stream WindowLoader per component: its windows view, epoch orders, id checks, labels
        self.parts = [WindowLoader(ds, seq_len, 1, seed=seed, vocab_size=vocab_size, vocab_from=vocab_from,
                                   stream=k, **args[k]) for k, (_, _, ds) in enumerate(parts)]
        if global_batch_size % world_size:
            raise UserError(f"train.global_batch_size {global_batch_size} is not divisible by the world size {world_size}")
        self.names = [name for name, _, _ in parts]
        self.raw_weights = [float(w) for _, w, _ in parts]
        self.weights = normalised(self.raw_weights)
        self.seq_len, self.seed, self.global_batch_size = seq_len, seed, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.local_batch_size = global_batch_size // world_size
        self.num_windows = sum(p.num_windows for p in self.parts)
        self.dataset = parts[0][2]  # for messages and the unigram entropy: the first component
        self.sample = 0  # global samples consumed (all ranks together)
        self.counts = [0] * len(parts)  # of which from each component
        self._first = 0
        self.last_components: np.ndarray | None = None  # this rank's rows' components, (B,)
        self.last_ids: np.ndarray | None = None

    def _window(self, k: int, n: np.ndarray) -> np.ndarray:
        """Component k's windows for its samples ``n`` (m,) (consecutive, so at most a few epochs)."""
        part = self.parts[k]
        epochs, pos = np.divmod(n, part.num_windows)
        out = np.empty(n.size, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = part._order(int(e))[pos[sel]]
        return out

    def __iter__(self) -> "MixLoader":
        return self

    def __next__(self) -> np.ndarray:
        G, B = self.global_batch_size, self.local_batch_size
        self._first = self.sample
        before = list(self.counts)
        comp = blend(self.weights, self.counts, self.sample, G)  # (G,) the whole global batch, on every rank
        self.sample += G
        lo, hi = self.rank * B, (self.rank + 1) * B
        mine = comp[lo:hi]  # (B,)
        batch = np.empty((B, self.seq_len + 1), dtype=np.int64)
        ids = np.empty(B, dtype=np.int64)
        for k in np.unique(mine):
            rows = np.flatnonzero(comp == k)  # global rows of component k, in order
            n = before[k] + np.arange(rows.size)  # their per-component sample numbers
            take = (rows >= lo) & (rows < hi)
            ids[rows[take] - lo] = w = self._window(int(k), n[take])
            batch[rows[take] - lo] = self.parts[k].read(w)
        self.last_components, self.last_ids = mine, ids
        return batch

    def last_documents(self) -> np.ndarray | None:
        """Each row's per-token document index (B, T) int64 (``WindowLoader.documents`` of its component)."""
        if self.last_ids is None:
            return None
        out = np.empty((self.last_ids.size, self.seq_len), dtype=np.int64)
        for k in np.unique(self.last_components):
            rows = np.flatnonzero(self.last_components == k)
            out[rows] = self.parts[int(k)].documents(self.last_ids[rows])
        return out

    def last_labels(self) -> np.ndarray | None:
        """Concept-label evidence of the last batch's inputs, (B, T, n) bool: each row's from its own
        component's label file at its window (None when the components carry no labels)."""
        if self.last_ids is None or any(p.labels is None for p in self.parts):
            return None
        T = self.seq_len
        return np.stack([self.parts[int(k)].labels.window(int(i) * T, T)
                         for k, i in zip(self.last_components, self.last_ids)])

    def label_streams(self) -> list[tuple[np.ndarray, Any]]:
        """``(tokens, LabelSpans)`` per component that carries labels (a steering stage's lift tokens)."""
        return [(p.dataset.tokens, p.labels) for p in self.parts if p.labels is not None]

    def last_sources(self) -> None:
        return None

    def sample_ids(self) -> np.ndarray:
        """(local_batch_size,) int64: the global sample index of each row of the last batch."""
        start = self._first + self.rank * self.local_batch_size
        return np.arange(start, start + self.local_batch_size, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "kind": "mix", "seed": self.seed, "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "components": [{"name": n, "weight": w, "num_tokens": int(p.dataset.num_tokens),
                            "num_sequences": len(p.dataset)}
                           for n, w, p in zip(self.names, self.raw_weights, self.parts)],
            "sample": self.sample, "counts": list(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Continue from ``state``; every mismatch is reported at once (``source`` names the file)."""
        if state.get("kind") != "mix":
            raise UserError(f"{source}: the checkpoint was trained on one dataset, this recipe has data.mix",
                            hint=_RESUME_HINT)
        current = self.state_dict()
        problems = [f"{source}: data loader {key} is {state.get(key)} in the checkpoint but {current[key]} now"
                    for key in ("version", "seed", "seq_len", "global_batch_size", "components")
                    if state.get(key) != current[key]]
        sample, counts = state.get("sample"), state.get("counts")
        if not (isinstance(sample, int) and isinstance(counts, list) and len(counts) == len(self.parts)
                and all(isinstance(c, int) and c >= 0 for c in counts) and sum(counts) == sample):
            problems.append(f"{source}: data loader position (sample {sample}, counts {counts}) is not a mixture position")
        if problems:
            raise UserError(*problems, hint=_RESUME_HINT)
        self.sample, self.counts = sample, list(counts)


# ----------------------------------------------------------------------------- where components live


def component_dir(run_dir: Path, name: str) -> Path:
    """A ``sources`` component's run directory: tokenize writes its data/{train,val} there."""
    return Path(run_dir) / "mix" / name


def prefixes(recipe: Any, split: str) -> list[tuple[str, float, str | None]]:
    """``(name, weight, prefix or None)`` per ``data.mix`` component for ``split`` (train / val): a
    ``prefix`` component's own (``val_prefix``: may be None), a ``sources`` component's tokenized split."""
    out = []
    for c in recipe.data.mix:
        if c.prefix is not None:
            out.append((c.name, c.weight, c.prefix if split == "train" else c.val_prefix))
        else:
            out.append((c.name, c.weight, str(component_dir(recipe.run_dir, c.name) / "data" / split)))
    return out


def open_parts(recipe: Any, split: str, info: Callable[[str], None]) -> list[tuple[str, float, IndexedDataset]]:
    """The components' datasets of ``split`` (val: only those that have one), checked to share one
    tokenizer (meta.json's sha256, where the dataset has a meta.json)."""
    parts, missing = [], []
    for i, (name, w, prefix) in enumerate(prefixes(recipe, split)):
        if prefix is None:
            continue
        if not all(p.is_file() for p in paths(prefix)):
            missing.append(f"data.mix[{i}] ({name}): no {split} data at {prefix}.bin/.idx")
            continue
        parts.append((name, w, IndexedDataset(prefix)))
    if missing:
        raise UserError(*missing, hint=f"run `ncpctl tokenize {recipe.path}` for components with sources, "
                        "or point a component's prefix at its Megatron dataset")
    check_tokenizers(parts)
    return parts


def check_tokenizers(parts: list[tuple[str, float, IndexedDataset]]) -> None:
    """Every component with a meta.json must have been tokenized by the same tokenizer.json."""
    seen: tuple[str, str] | None = None
    for name, _, ds in parts:
        meta_path = Path(ds.prefix).parent / "meta.json"
        recorded = read_meta(meta_path)
        if recorded is None:
            continue  # a dataset made elsewhere: the loaders' vocabulary check still applies
        sha = (recorded.get("tokenizer") or {}).get("sha256")
        if seen is None:
            seen = (name, sha)
        elif sha != seen[1]:
            raise UserError(f"data.mix: component {name!r} was tokenized with another tokenizer than {seen[0]!r} "
                            f"({meta_path}: tokenizer sha256 {str(sha)[:12]}, not {str(seen[1])[:12]})",
                            hint="tokenize every component with the same tokenizer.path")


# ----------------------------------------------------------------------------- tokenize


def tokenize_mix(recipe: Any, tokenize: Callable[[Any], dict[str, Any]], force: bool) -> dict[str, Any]:
    """``ncpctl tokenize`` of a recipe with ``data.mix``: the sources of every ``sources`` component,
    in order, are tokenized as one corpus into run.dir/data (one tokenizer, trained on the train
    split of them all, and meta.json counting documents per source), then each component's
    documents (a contiguous range of sources, hence of sequences) are copied into its own
    run.dir/mix/NAME/data/{train,val} with a meta.json of its own."""
    comps = [c for c in recipe.data.mix if c.sources]
    union = dataclasses.replace(recipe, data=recipe.data.model_copy(
        update={"sources": [s for c in comps for s in c.sources], "mix": []}))
    meta = tokenize(union)
    first = 0
    written = {}
    for c in comps:
        out = component_dir(recipe.run_dir, c.name) / "data"
        cmeta = _component_meta(meta, first, len(c.sources), c)
        old = None if force else _component_current(out, cmeta)
        if old is None:
            _write_component(recipe.data_dir, out, meta, first, len(c.sources), cmeta)
        else:
            cmeta = old
        written[c.name] = {"prefix_dir": str(out), **{split: cmeta["splits"][split]["tokens"] for split in ("train", "val")}}
        first += len(c.sources)
    recipe.write_resolved(recipe.run_dir)  # the recipe itself (the union's was written above)
    return {**meta, "mix": written}


def _component_meta(meta: dict[str, Any], first: int, n: int, comp: Any) -> dict[str, Any]:
    splits = {}
    for split in ("train", "val"):
        per = meta["splits"][split]["documents_per_source"]
        splits[split] = {"documents": int(sum(per[first:first + n])), "documents_per_source": per[first:first + n]}
    labels = {"labels": {**meta["labels"], "spans": {}}} if meta.get("labels") else {}  # one vocabulary for all
    return {**{k: meta[k] for k in ("format_version", "fingerprint", "tokenizer", "dtype")}, **labels,
            "component": comp.name, "sources": meta["sources"][first:first + n],
            "source_labels": meta["source_labels"][first:first + n], "splits": splits}


def _component_current(out: Path, cmeta: dict[str, Any]) -> dict[str, Any] | None:
    """The component's meta.json if its data was copied from this very union, else None."""
    path = out / "meta.json"
    if not path.is_file():
        return None
    try:  # a damaged one is rebuilt like a stale one
        old = check_meta(path, json.loads(path.read_text()))
    except (UserError, ValueError, RecursionError):
        return None
    files = [p for s in ("train", "val") for p in paths(out / s)]
    if "labels" in cmeta:
        files += [labels_path(out / s) for s in ("train", "val")]
    same = (old.get("fingerprint") == cmeta["fingerprint"] and old.get("sources") == cmeta["sources"]
            and all(p.is_file() for p in files))
    return old if same else None


def _write_component(data_dir: Path, out: Path, meta: dict[str, Any], first: int, n: int,
                     cmeta: dict[str, Any]) -> None:
    """Copy sequences of sources ``first .. first+n-1`` of the union's splits into ``out``."""
    for split in ("train", "val"):
        ds = IndexedDataset(data_dir / split)
        per = np.asarray(meta["splits"][split]["documents_per_source"], dtype=np.int64)
        a, b = int(per[:first].sum()), int(per[:first + n].sum())  # the component's sequences [a, b)
        start = int(ds.pointers[a]) // ds.dtype.itemsize if a < len(ds) else ds.num_tokens
        end = int(ds.pointers[b]) // ds.dtype.itemsize if b < len(ds) else ds.num_tokens
        with IndexedDatasetWriter(out / split, ds.dtype) as w:
            w.add_documents(np.asarray(ds.tokens[start:end]), np.asarray(ds.sizes[a:b], dtype=np.int64))
        stats = w.finalize()
        cmeta["splits"][split].update(tokens=stats.tokens, max_id=stats.max_id)
        if "labels" in cmeta:  # the union's label spans inside [start, end), shifted to the component's stream
            cmeta["labels"]["spans"][split] = _write_component_labels(data_dir / split, out / split, start, end)
    atomic_write(out / "meta.json", json.dumps(cmeta, indent=2) + "\n")


def _write_component_labels(union: Path, out: Path, start: int, end: int) -> int:
    """``union``'s label spans (K, 3) [a, b, label] of tokens ``start .. end-1`` (spans never cross a
    document, so none crosses a component) as ``out``'s, in the component's token positions."""
    arr = np.load(labels_path(union))
    mine = arr[(arr[:, 0] >= start) & (arr[:, 0] < end)].copy()
    mine[:, :2] -= start

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would append .npy to the temporary name
            np.save(f, mine)

    # atomic, and a full disk is one line: the component's tokens are written the same way
    atomic_write_with(labels_path(out), save)
    return int(mine.shape[0])
