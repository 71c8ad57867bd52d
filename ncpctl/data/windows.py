"""Training windows over an indexed dataset: shuffled, data-parallel sharded, resumable.

Like Megatron's GPTDataset, documents (each already ending in EOD) are one flat token
stream, cut into windows of ``seq_len + 1`` tokens that overlap by one token::

    window i = tokens[i*T : i*T + T + 1]
    num_windows = (num_tokens - 1) // T

The model's objective turns a window into its inputs and targets (``Objective.batch``;
next-token prediction: inputs = w[:, :-1], targets = w[:, 1:]).

Each epoch visits every window once in an order fixed by ``(seed, epoch)``. A step takes
the next ``global_batch_size`` windows of that order (rolling into the next epoch when
needed); rank ``r`` of ``world_size`` gets the contiguous slice ``r*B : (r+1)*B`` with
``B = global_batch_size // world_size``, so the ranks together see exactly the batch a
single process would. numpy only; the caller makes tensors.

Every batch is checked as it is read: an id at or above ``vocab_size`` (or below 0) would index
past the embedding (an IndexError on a CPU, silent garbage or a device assert on a GPU), so
it is a ``UserError`` naming the file and the token. One max (and, for signed dtypes, one min)
over the batch's ``B * (T+1)`` ids: nothing next to a step, and no scan of the corpus at start.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ncpctl.data.indexed import IndexedDataset
from ncpctl.errors import UserError

STATE_VERSION = 1
_RESUME_HINT = ("resume with the same data, train.seq_len, train.global_batch_size and train.seed as "
                "the checkpoint, or start a fresh run (train.resume: never)")


def epoch_order(num_windows: int, seed: int, epoch: int, stream: int | None = None) -> np.ndarray:
    """The permutation of ``range(num_windows)`` visited in ``epoch``: ``(num_windows,)``.
    ``stream``: an independent order for the same seed (a ``data.mix`` component's index).

    Sorted raw PCG64 draws rather than ``Generator.permutation``: numpy guarantees the raw
    bit-generator stream (and SeedSequence) across versions and platforms (NEP 19), but not
    the algorithms built on it, and the data order must not change when numpy is upgraded.
    """
    entropy = [seed, epoch] if stream is None else [seed, epoch, stream]
    keys = np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(num_windows)  # (n,) uint64
    order = np.argsort(keys, kind="stable")  # stable: ties (p ~ n^2 / 2^65) still break the same way
    return order.astype(np.int32) if num_windows < 2**31 else order  # half the memory on big corpora


class SourceMap:
    """Which ``data.sources`` entry each token of a dataset came from, for per-source metrics
    (validation's tokens per concept, DLCM Table 5). A dataset's sequences are its documents in
    source order (``ncpctl tokenize`` writes them so and records ``documents_per_source`` per
    split in meta.json), so token offset o is in sequence ``searchsorted(starts, o, 'right') - 1``
    and that sequence's source follows from the cumulative counts."""

    def __init__(self, dataset: IndexedDataset, documents_per_source: list[int], labels: list[str]):
        counts = np.asarray(documents_per_source, dtype=np.int64)
        if counts.ndim != 1 or len(counts) != len(labels) or (counts < 0).any() or counts.sum() != len(dataset):
            raise ValueError(f"{dataset.idx_path}: documents_per_source {documents_per_source} does not fit the "
                             f"{len(dataset)} sequences and {len(labels)} sources")
        self.labels = list(labels)
        self._starts = dataset.pointers // dataset.dtype.itemsize  # (n,) first token of each sequence
        self._doc_ends = np.cumsum(counts)  # (S,) sequences before the end of each source
        self._num_tokens = int(dataset.num_tokens)

    def ranges(self) -> list[tuple[int, int]]:
        """Each source's tokens as one contiguous range [start, end) of token offsets (empty for a
        source with no document in this split)."""
        bounds = np.concatenate([[0], self._doc_ends])  # (S+1,) sequence index at each source's start
        first = np.append(self._starts, self._num_tokens)  # token offset of sequence i, and the end
        return [(int(first[a]), int(first[b])) for a, b in zip(bounds[:-1], bounds[1:])]

    def sources(self, offsets: np.ndarray) -> np.ndarray:
        """Token offsets (any shape) -> the source index of each, same shape (int64)."""
        seq = np.searchsorted(self._starts, offsets, side="right") - 1
        return np.searchsorted(self._doc_ends, seq, side="right")


class WindowLoader:
    """Iterator over training batches, ``(global_batch_size // world_size, seq_len + 1)`` int64.

    Never stops: epochs roll over inside a batch if needed. ``state_dict()`` after a batch
    and ``load_state_dict()`` on a fresh loader continue with exactly the next batch. The
    state does not depend on ``rank``/``world_size``, so a run may resume on more or fewer ranks.
    """

    def __init__(self, dataset: IndexedDataset, seq_len: int, global_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, labels: Any | None = None,
                 sources: SourceMap | None = None, vocab_size: int | None = None,
                 vocab_from: str = "", stream: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) must be >= 1")
        problems = []
        if seed < 0:
            problems.append(f"train.seed must be >= 0 for the data order (got {seed})")
        if global_batch_size % world_size:
            problems.append(f"train.global_batch_size {global_batch_size} is not divisible by "
                            f"the world size {world_size}")
        self.num_windows = (dataset.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            problems.append(f"{dataset.bin_path}: dataset has {dataset.num_tokens} tokens, fewer than "
                            f"one window of seq_len+1 = {seq_len + 1}")
        if problems:
            raise UserError(*problems)

        self.dataset, self.seq_len, self.seed, self.stream = dataset, seq_len, seed, stream
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self.local_batch_size = global_batch_size // world_size
        tokens = dataset.tokens  # (num_tokens,) memmap
        # (num_windows, T+1) view whose row i starts at token i*T: a batch is one fancy-index
        # gather of B rows, no per-token Python work and no copy of the corpus.
        self._windows = as_strided(tokens, shape=(self.num_windows, seq_len + 1),
                                   strides=(seq_len * tokens.strides[0], tokens.strides[0]),
                                   writeable=False)
        # ids must be below vocab_size; vocab_from names the recipe key it came from, for the message
        self.vocab_size, self.vocab_from = vocab_size, vocab_from
        self.labels = labels  # ncpctl.data.labels.LabelSpans of the dataset, or None
        self.sources = sources  # which data.sources entry each token is from, or None
        self.last_ids: np.ndarray | None = None  # this rank's window ids of the last batch
        self.epoch = 0
        self.position = 0  # windows of `epoch` already consumed (by all ranks together)
        self._orders: dict[int, np.ndarray] = {}
        self._first = 0  # global sample index of the last batch's first window

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # Keep at most the previous epoch besides this one: a batch spans at most two
            # epochs unless an epoch is smaller than a batch (then recomputing is cheap).
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = epoch_order(self.num_windows, self.seed, epoch, self.stream)
        return self._orders[epoch]

    def next_window_ids(self) -> np.ndarray:
        """Advance one step; the global batch's window ids ``(global_batch_size,)``."""
        self._first = self.epoch * self.num_windows + self.position
        parts, need = [], self.global_batch_size
        while need:
            take = self._order(self.epoch)[self.position:self.position + need]
            parts.append(take)
            need -= take.size
            self.position += take.size
            if self.position == self.num_windows:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(parts)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        ids = self.next_window_ids()
        mine = ids[self.rank * self.local_batch_size:(self.rank + 1) * self.local_batch_size]  # (B,)
        self.last_ids = mine
        return self.read(mine)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Windows ``ids`` (n,) as ``(n, seq_len + 1)`` int64, every id checked against the vocabulary."""
        batch = self._windows[ids]  # (n, T+1) in the file's dtype
        if self.vocab_size is not None:
            self._check_ids(batch, ids)
        return batch.astype(np.int64)

    def _check_ids(self, batch: np.ndarray, ids: np.ndarray) -> None:
        """Every id of ``batch`` (window ids ``ids``) must be in [0, vocab_size)."""
        top = int(batch.max())
        low = int(batch.min()) if batch.dtype.kind == "i" else 0
        if top < self.vocab_size and low >= 0:
            return
        bad = top if top >= self.vocab_size else low
        row, col = np.argwhere(batch == bad)[0]
        where = f" ({self.vocab_from})" if self.vocab_from else ""
        raise UserError(f"{self.dataset.bin_path}: token id {bad} at token {int(ids[row]) * self.seq_len + int(col):,} "
                        f"is outside the model's vocabulary of {self.vocab_size} ids{where}",
                        hint="the data was tokenized with another tokenizer, or the .bin is damaged")

    def documents(self, ids: np.ndarray) -> np.ndarray:
        """Document index of each input token of windows ``ids`` (n,), counted from 0 in each row:
        (n, seq_len) int64, non-decreasing along a row. Window i's inputs are tokens i*T .. i*T+T-1;
        documents are the index's (Megatron's ``doc_idx`` over sequences: ``ncpctl tokenize`` writes
        one sequence per document, ending in EOD), found by binary search in the memory-mapped index."""
        ds, T = self.dataset, self.seq_len
        offsets = ids.astype(np.int64)[:, None] * T + np.arange(T)  # (n, T) token offsets
        seq = np.searchsorted(ds.pointers, offsets * ds.dtype.itemsize, side="right") - 1
        doc = np.searchsorted(ds.doc_idx, seq, side="right") - 1
        return (doc - doc[:, :1]).astype(np.int64)

    def last_documents(self) -> np.ndarray | None:
        """``documents`` of the last batch, (B, T) int64 (None before the first batch)."""
        return None if self.last_ids is None else self.documents(self.last_ids)

    def last_labels(self) -> np.ndarray | None:
        """Concept-label evidence of the last batch's inputs, (B, T, n) bool (None without labels):
        window i's inputs are tokens i*T .. i*T+T-1."""
        if self.labels is None or self.last_ids is None:
            return None
        T = self.seq_len
        return np.stack([self.labels.window(int(i) * T, T) for i in self.last_ids])

    def label_streams(self) -> list[tuple[np.ndarray, Any]]:
        """``[(tokens, LabelSpans)]`` of the dataset when it carries labels, else ``[]``."""
        return [] if self.labels is None else [(self.dataset.tokens, self.labels)]

    def last_sources(self) -> np.ndarray | None:
        """The source index of each input token of the last batch, (B, T) int64 (None without a
        ``SourceMap``): window i's inputs are tokens i*T .. i*T+T-1."""
        if self.sources is None or self.last_ids is None:
            return None
        T = self.seq_len
        return self.sources.sources(self.last_ids.astype(np.int64)[:, None] * T + np.arange(T))

    def sample_ids(self) -> np.ndarray:
        """(local_batch_size,) int64: the global sample index of each row of the last batch, i.e.
        the windows all ranks consumed before it, counted over epochs (step s, global row i: s*G + i
        in a run that never changed its batch size). It does not depend on ``rank``/``world_size``,
        so a key derived from it (DLCM's boundary noise) is the same for any number of ranks."""
        start = self._first + self.rank * self.local_batch_size
        return np.arange(start, start + self.local_batch_size, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position plus what must match on resume (order and dataset)."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_tokens": int(self.dataset.num_tokens),
            "num_sequences": len(self.dataset),
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Continue from ``state``; every mismatch is reported at once (``source`` names the file)."""
        current = self.state_dict()
        missing = sorted(set(current) - set(state))
        if missing:
            raise UserError(f"{source}: data loader state lacks {', '.join(missing)}", hint=_RESUME_HINT)
        problems = [f"{source}: data loader {key} is {state[key]} in the checkpoint but {current[key]} now"
                    for key in ("version", "seed", "seq_len", "global_batch_size", "num_tokens", "num_sequences")
                    if state[key] != current[key]]
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
                and 0 <= position < self.num_windows):
            problems.append(f"{source}: data loader position (epoch {epoch}, window {position}) is outside "
                            f"the {self.num_windows} windows of an epoch")
        if problems:
            raise UserError(*problems, hint=_RESUME_HINT)
        self.epoch, self.position = epoch, position
