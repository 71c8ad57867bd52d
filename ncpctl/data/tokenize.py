"""`ncpctl tokenize`: corpus -> byte-level BPE -> Megatron indexed datasets under run.dir/data.

Output (the layout scripts rely on): ``data/train.{bin,idx}``, ``data/val.{bin,idx}``,
``data/tokenizer.json``, ``data/meta.json``, ``data/recipe.resolved.yaml``.

Safety: everything is written into ``run.dir/.data.tmp-PID`` and swapped in with renames
only after it is complete, so an interrupted run never leaves a dataset that looks
complete, and the previous dataset stays intact until the new one is whole. Re-running with
unchanged inputs and settings is a no-op (fingerprint in meta.json).

Speed: encoding runs in the tokenizers Rust thread pool (all cores) on chunks of documents
(at most ``data.batch_documents`` documents and about ``ENCODE_CHARS`` characters each), with
up to ``ENCODE_DEPTH`` chunks in flight, while this thread reads the next documents and turns
finished chunks into flat id arrays and writes them. The Python side (reading, flattening,
writing) so overlaps the Rust side instead of adding to it, and the Rust pool always has other
chunks to work on while one long document finishes. ``bench/tokenize.py`` measures it.

Memory: a document longer than ``ENCODE_CHARS`` is cut into pieces of about ``PIECE_CHARS``
where the tokenizer provably merges nothing across the cut (``ncpctl.data.pieces``: its ids
are exactly those of encoding it whole), encoded a chunk of pieces at a time and written in
parts, so a 30 MB single-line document no longer holds gigabytes of Rust encodings at once
(and its pieces encode in parallel). BPE training reads the same pieces (the same pre-tokens,
so the same counts and merges). A tokenizer whose pipeline is not known to allow this encodes
such a document whole, as before, and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from array import array
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ncpctl import __version__
from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from ncpctl.data.labels import write_labels
from ncpctl.data.meta import check as check_meta
from ncpctl.data.mix import tokenize_mix
from ncpctl.corpora.packages import cached_listings, is_packages_source
from ncpctl.data.pieces import cut_refusal, pieces
from ncpctl.data.sources import ReadStats, count_documents, documents, fingerprint, iter_documents, package_summary, \
    source_labels
from ncpctl.data.swap import remove_stale_tmp, swap_in
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, disk_errors
from ncpctl.recipe.load import Recipe

FORMAT_VERSION = 1
SPLITS = ("train", "val")
# Encode chunks: ~1M characters (~0.3M tokens) is large next to the per-call cost, small enough
# that reading/flattening/writing overlaps encoding even on a corpus of one batch. DEPTH chunks
# in flight keep both the Rust pool busy and memory bounded (~DEPTH chunks of Encodings).
ENCODE_CHARS = 1 << 20
ENCODE_DEPTH = 4
PIECE_CHARS = 1 << 18  # pieces of a long document: four to an encode chunk, encoded in parallel


@dataclasses.dataclass
class _Chunk:
    """What one encode call gets: whole documents, or consecutive pieces of one long document."""

    idx: np.ndarray  # (n,) global document indices (one index for pieces)
    texts: list[str]
    pieces: bool = False
    end: bool = True  # pieces: this chunk holds the document's last piece


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _uniform(doc_index: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64(seed, index) -> uniform [0, 1) per document; (n,) float64.

    Independent of batch size, source boundaries and machine.
    """
    with np.errstate(over="ignore"):
        z = doc_index.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _is_val(doc_index: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Deterministic per-document split: ``_uniform(seed, index) < fraction``; (n,) bool."""
    return _uniform(doc_index, seed) < fraction


@dataclasses.dataclass(frozen=True)
class Split:
    """Which documents are validation: the per-document hash (``_is_val``), except for at most
    one document moved so that neither split is empty.

    On a small corpus the hash alone can leave a split empty (17 documents at
    ``val_fraction: 0.02`` give no validation document with the default seed). Then the
    document the hash came closest to putting in that split is moved: the train document
    with the lowest uniform value goes to validation (or, if every document landed in
    validation, the one with the highest value goes to train). That choice depends only on
    the seed and the set of document indices, so it is as deterministic as the hash, and a
    corpus whose hash split has both splits non-empty is split exactly as before.
    """

    seed: int
    fraction: float
    to_val: int | None = None  # a document index the hash puts in train
    to_train: int | None = None  # a document index the hash puts in validation

    def is_val(self, doc_index: np.ndarray) -> np.ndarray:
        val = _is_val(doc_index, self.seed, self.fraction)
        if self.to_val is not None:
            val |= doc_index == self.to_val
        if self.to_train is not None:
            val &= doc_index != self.to_train
        return val


@dataclasses.dataclass
class _Extremes:
    """The documents nearest the split boundary: (uniform value, index) of the train document
    with the lowest value and of the validation document with the highest (ties: lower index)."""

    lowest_train: tuple[float, int] | None = None
    highest_val: tuple[float, int] | None = None

    def see(self, doc_index: np.ndarray, val: np.ndarray, seed: int) -> None:
        u = _uniform(doc_index, seed)
        if not val.all():
            j = int(np.argmin(np.where(val, np.inf, u)))
            cand = (float(u[j]), int(doc_index[j]))
            self.lowest_train = min(self.lowest_train or cand, cand)
        if val.any():
            j = int(np.argmax(np.where(val, u, -np.inf)))
            cand = (float(u[j]), int(doc_index[j]))
            best = self.highest_val or cand
            self.highest_val = cand if (cand[0], -cand[1]) > (best[0], -best[1]) else best

    def rebalanced(self, split: Split, n_train: int, n_val: int) -> Split | None:
        """The split with one document moved when a split is empty and moving can fix it
        (two or more documents, a non-zero ``val_fraction``); else None."""
        if n_train + n_val < 2 or split.fraction <= 0:
            return None
        if n_val == 0 and self.lowest_train is not None:
            return dataclasses.replace(split, to_val=self.lowest_train[1])
        if n_train == 0 and self.highest_val is not None:
            return dataclasses.replace(split, to_train=self.highest_val[1])
        return None


def settings_fingerprint(recipe: Recipe) -> str:
    """Everything that changes the output: sources (files, sizes, mtimes) and settings."""
    d, t = recipe.data, recipe.tokenizer
    settings = {
        "format": FORMAT_VERSION,
        "sources": fingerprint(d.sources),
        "tokenizer": t.model_dump(mode="json"),
        "tokenizer_file": _sha256(Path(t.path)) if t.path else None,
        "split": [d.val_fraction, d.split_seed],
        "dtype": d.dtype,
        "min_chars": d.min_chars,
        "max_documents": d.max_documents,
    }
    if d.labels != "none":  # only then, so that datasets without labels keep their fingerprint
        settings["labels"] = [d.labels, d.labels_field]
    if specials(recipe):  # the model's designs' special tokens (after EOD), likewise only then
        settings["special_tokens"] = specials(recipe)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _up_to_date(data_dir: Path, fp: str) -> dict[str, Any] | None:
    """meta.json of a complete dataset made with the same fingerprint, else None."""
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        return None
    try:  # a damaged one means: tokenize again
        meta = check_meta(meta_path, json.loads(meta_path.read_text()))
    except (OSError, ValueError, RecursionError, UserError):
        return None
    if meta.get("fingerprint") != fp:
        return None
    tok = data_dir / "tokenizer.json"
    if not tok.is_file() or _sha256(tok) != (meta.get("tokenizer") or {}).get("sha256"):
        return None
    for split in SPLITS:
        try:
            ds = IndexedDataset(data_dir / split)
        except UserError:
            return None
        if ds.num_tokens != ((meta.get("splits") or {}).get(split) or {}).get("tokens"):
            return None
    return meta


def specials(recipe: Recipe) -> list[str]:
    """The special tokens the model's designs need (``ModelConfig.special_tokens``), added after EOD."""
    return list(recipe.model_config.special_tokens().values()) if recipe.model_config is not None else []


def train_bpe(recipe: Recipe, stats: ReadStats, split: Split | None = None):  # -> tokenizers.Tokenizer
    """A byte-level BPE trained on (at most train_max_bytes of) the training split
    (``split``: default the recipe's per-document hash split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t, d = recipe.tokenizer, recipe.data
    split = split or Split(d.split_seed, d.val_fraction)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=t.vocab_size,
        min_frequency=t.min_frequency,
        special_tokens=[t.eod_token, *specials(recipe)],  # EOD id 0, as in Pythia's; the model's (a [MASK]) next
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    cut = cut_refusal(tok) is None  # the pipeline set above: always, unless it changes

    def texts() -> Iterator[str]:
        budget = t.train_max_bytes
        for idx, batch in documents(recipe.data, stats):
            val = split.is_val(idx)
            for text, v in zip(batch, val):
                if v:
                    continue
                if cut and len(text) > ENCODE_CHARS:
                    yield from pieces(text, PIECE_CHARS)  # the same pre-tokens: the same counts
                else:
                    yield text
                budget -= len(text)
                if budget <= 0:
                    return

    tok.train_from_iterator(texts(), trainer)
    return tok


def load_or_train_tokenizer(recipe: Recipe, stats: ReadStats, split: Split | None = None):
    from tokenizers import Tokenizer

    if recipe.tokenizer.path:
        return Tokenizer.from_file(recipe.tokenizer.path), False
    return train_bpe(recipe, stats, split), True


def _flatten(encodings: list[Any], eod: int, chunk: _Chunk) -> tuple[np.ndarray, np.ndarray]:
    """Encodings of n docs -> (flat ids with EOD after every doc (sum(len)+n,), lengths (n,));
    of a chunk of pieces -> (their ids in order, EOD after the document's last piece; (1,)).

    The flat array is uint32, the type tokenizers ids have, so no id can wrap around; the
    writer checks every id against the dataset dtype.
    """
    buf = array("I")  # appends in C: no per-token Python work beyond the .ids list itself
    assert buf.itemsize == 4
    lens = np.empty(1 if chunk.pieces else len(encodings), dtype=np.int64)
    for i, e in enumerate(encodings):
        ids = e.ids
        buf.extend(ids)
        if not chunk.pieces:
            buf.append(eod)
            lens[i] = len(ids) + 1
    if chunk.pieces:
        if chunk.end:
            buf.append(eod)
        lens[0] = len(buf)
    return np.frombuffer(buf, dtype=np.uint32), lens


@dataclasses.dataclass
class _Sink:
    """Where encoded chunks go, in corpus order: the split writers and what meta.json counts."""

    writers: dict[str, IndexedDatasetWriter]  # "train", "val"
    split: Split
    starts: list[int]  # each source's first global document index
    per_source: dict[str, np.ndarray]  # per split: (n_sources,) documents
    extremes: _Extremes
    documents: int = 0
    tokens: int = 0

    def write(self, chunk: _Chunk, flat: np.ndarray, lens: np.ndarray) -> int:
        """Write one chunk's ids; returns how many documents it completed."""
        val = self.split.is_val(chunk.idx)
        if chunk.pieces:  # one document, written in parts
            self.writers["val" if val[0] else "train"].add_part(flat, end=chunk.end)
        self.tokens += int(flat.shape[0])
        if not chunk.end:
            return 0
        self.extremes.see(chunk.idx, val, self.split.seed)
        src = np.searchsorted(self.starts, chunk.idx, side="right") - 1  # (n,) each document's source
        for name, mask in (("train", ~val), ("val", val)):
            if mask.any():
                if not chunk.pieces:
                    self.writers[name].add_documents(*_select(flat, lens, mask))
                self.per_source[name] += np.bincount(src[mask], minlength=len(self.per_source[name]))
        self.documents += len(chunk.idx)
        return len(chunk.idx)


def _chunks(batches: Iterator[tuple[np.ndarray, list[str]]], refusal: str | None,
            log: Callable[[str], None]) -> Iterator[_Chunk]:
    """Split document batches into encode chunks of about ENCODE_CHARS characters: whole
    documents, or a document longer than that as chunks of its pieces (``refusal``: why the
    tokenizer's documents cannot be cut, None when they can)."""
    told = False
    for idx, texts in batches:
        start, chars = 0, 0
        for i, text in enumerate(texts):
            if refusal is not None and len(text) > ENCODE_CHARS and not told:
                log(f"document {int(idx[i])} has {len(text):,} characters; encoding such documents whole "
                    f"(in memory) because {refusal}")
                told = True
            if refusal is None and len(text) > ENCODE_CHARS:
                if start < i:
                    yield _Chunk(idx[start:i], texts[start:i])
                yield from _piece_chunks(idx[i:i + 1], text)
                start, chars = i + 1, 0
                continue
            chars += len(text)
            if chars >= ENCODE_CHARS:
                yield _Chunk(idx[start:i + 1], texts[start:i + 1])
                start, chars = i + 1, 0
        if start < len(texts):
            yield _Chunk(idx[start:], texts[start:])


def _piece_chunks(idx: np.ndarray, text: str) -> Iterator[_Chunk]:
    """One long document as chunks of about ENCODE_CHARS characters of its pieces, in order."""
    group: list[str] = []
    chars = 0
    for piece in pieces(text, PIECE_CHARS):
        if group and chars + len(piece) > ENCODE_CHARS:
            yield _Chunk(idx, group, pieces=True, end=False)
            group, chars = [], 0
        group.append(piece)
        chars += len(piece)
    yield _Chunk(idx, group, pieces=True, end=True)


def _select(flat: np.ndarray, lens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The docs of a flat batch where mask is True (vectorised; no per-doc loop)."""
    return flat[np.repeat(mask, lens)], lens[mask]


def tokenize(
    recipe: Recipe,
    *,
    force: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    on_total: Callable[[int | None], None] | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> dict[str, Any]:
    """Run the whole tokenize stage for ``recipe``; returns meta.json's content.

    ``on_progress(documents, tokens)`` is called after every batch (for a progress bar);
    ``on_total(documents or None)`` when encoding starts; ``log(message)`` for stage messages.
    """
    with cached_listings():  # builtin:python-packages: walk site-packages once per run, not per pass
        if recipe.data.mix:  # every component with sources, then a prefix per component (ncpctl.data.mix)
            return tokenize_mix(recipe, lambda r: _tokenize(r, force, on_progress, on_total, log), force)
        return _tokenize(recipe, force, on_progress, on_total, log)


def _tokenize(recipe: Recipe, force: bool, on_progress: Any, on_total: Any, log: Any) -> dict[str, Any]:
    run_dir, data_dir = recipe.run_dir, recipe.data_dir
    fp = settings_fingerprint(recipe)
    if not force and (meta := _up_to_date(data_dir, fp)) is not None:
        return {**meta, "up_to_date": True}

    tmp = run_dir / f".data.tmp-{os.getpid()}"
    with disk_errors(tmp):  # a full or read-only disk: one line naming the file (else this directory)
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(run_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            meta = _tokenize_into(recipe, tmp, fp, on_progress, on_total, log)
            recipe.write_resolved(tmp)
            swap_in(tmp, data_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        recipe.write_resolved(run_dir)
    return {**meta, "up_to_date": False}


@dataclasses.dataclass
class _Pass:
    """What one pass over the corpus wrote into the output directory (tokenizer, train/val)."""

    trained: bool
    vocab: int
    eod: int
    special: dict[str, int | None]  # the model's designs' special tokens -> id
    dtype: np.dtype
    documents: int
    tokens: int
    splits: dict[str, dict[str, Any]]  # per split: the writer's counts and documents_per_source
    stats: ReadStats
    seconds: dict[str, float]
    extremes: _Extremes


def _tokenize_into(recipe: Recipe, out: Path, fp: str, on_progress: Any, on_total: Any, log: Any) -> dict[str, Any]:
    d = recipe.data
    split = Split(d.split_seed, d.val_fraction)
    res = _encode_corpus(recipe, out, split, on_progress, on_total, log)
    moved = res.extremes.rebalanced(split, res.splits["train"]["documents"], res.splits["val"]["documents"])
    if moved is not None:
        # A small corpus the hash left without a validation (or train) document: move the one
        # document nearest the boundary and redo the pass, so the BPE is again trained on the
        # train split only. Only corpora that would otherwise fail pay for the second pass.
        which, doc = ("validation", moved.to_val) if moved.to_val is not None else ("train", moved.to_train)
        log(f"the hash split left the {which} split empty; moving document {doc} there and encoding again")
        split = moved
        res = _encode_corpus(recipe, out, split, None, None, log)
    n_docs, n_train, n_val = res.documents, res.splits["train"]["documents"], res.splits["val"]["documents"]
    if n_train == 0:
        raise UserError(f"data: all {n_docs} documents went to validation; lower data.val_fraction"
                        + (" or add documents (a train and a validation split need two)" if n_docs < 2 else ""))
    if d.val_fraction > 0 and n_val == 0:
        raise UserError(f"data: the validation split is empty ({n_docs} documents, val_fraction={d.val_fraction}); "
                        + ("add documents (a train and a validation split need two)" if n_docs < 2 else
                           "add documents or raise data.val_fraction"))
    stats = res.stats
    labels = None
    if d.labels != "none":
        labels = write_labels(recipe, out, split, log)
    meta = {
        "format_version": FORMAT_VERSION,
        "ncpctl_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fp,
        "source_fingerprint": fingerprint(d.sources),
        "sources": [s.model_dump(mode="json") for s in d.sources],
        # per-source metrics' names, in data.sources order (splits.*.documents_per_source counts them)
        "source_labels": source_labels(d.sources),
        # builtin:python-packages sources: documents per included package, held-out packages
        "packages": {s.path: package_summary(s) for s in d.sources if is_packages_source(s.path)},
        "tokenizer": {
            "sha256": _sha256(out / "tokenizer.json"),
            "vocab_size": res.vocab,
            "eod_id": res.eod,
            "eod_token": recipe.tokenizer.eod_token,
            "trained": res.trained,
            **({"special_tokens": res.special} if res.special else {}),  # the model's designs' (a [MASK])
        },
        "dtype": np.dtype(res.dtype).name,
        "splits": res.splits,
        # documents moved against the hash so that neither split is empty (see Split)
        "split": {"val_fraction": split.fraction, "split_seed": split.seed, "moved_to_val": split.to_val,
                  "moved_to_train": split.to_train},
        "documents": n_docs,
        "tokens": res.tokens,
        "skipped": {"undecodable": stats.undecodable, "undecodable_examples": stats.undecodable_examples,
                    "too_short": stats.too_short},
        "seconds": res.seconds,
        "tokens_per_second": round(res.tokens / max(res.seconds["encode"], 1e-9)),
    }
    if labels is not None:
        meta["labels"] = labels
    atomic_write(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _encode_corpus(recipe: Recipe, out: Path, split: Split, on_progress: Any, on_total: Any, log: Any) -> _Pass:
    """Tokenizer (trained on ``split``'s train documents, or loaded) and both splits into ``out``."""
    t0 = time.perf_counter()
    d = recipe.data
    stats = ReadStats()
    if recipe.tokenizer.path:
        log(f"loading tokenizer {recipe.tokenizer.path}")
    else:
        log(f"training a byte-level BPE (vocab {recipe.tokenizer.vocab_size}) on the train split")
    tok, trained = load_or_train_tokenizer(recipe, stats, split)
    stats = ReadStats()  # the BPE pass read a prefix; count skips over the full pass below
    eod = tok.token_to_id(recipe.tokenizer.eod_token)
    if eod is None:
        raise UserError(f"tokenizer.eod_token: {recipe.tokenizer.eod_token!r} is not in the tokenizer's vocabulary")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = best_dtype(vocab) if d.dtype == "auto" else np.dtype(d.dtype)
    tok.save(str(out / "tokenizer.json"))
    t_tok = time.perf_counter() - t0

    log(f"encoding into {recipe.data_dir} ({np.dtype(dtype).name}, EOD id {eod})")
    if on_total is not None:
        counts = [count_documents(s) for s in d.sources]
        total = None if None in counts else sum(c for c in counts if c is not None)
        if total is not None and d.max_documents is not None:
            total = min(total, d.max_documents)
        on_total(total)

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: less Rust work
    t1 = time.perf_counter()
    with IndexedDatasetWriter(out / "train", dtype) as w_train, IndexedDatasetWriter(out / "val", dtype) as w_val, \
            ThreadPoolExecutor(max_workers=ENCODE_DEPTH) as pool:
        # Up to DEPTH chunks encode in the Rust pool (GIL released) while this thread reads the
        # next chunk and flattens/writes the oldest finished one, in corpus order.
        in_flight: deque[tuple[_Chunk, Future[Any]]] = deque()
        sink = _Sink({"train": w_train, "val": w_val}, split, [], {n: np.zeros(len(d.sources), np.int64)
                                                                   for n in SPLITS}, _Extremes())
        chunks = _chunks(documents(recipe.data, stats, starts=sink.starts), cut_refusal(tok), log)
        while True:
            while len(in_flight) < ENCODE_DEPTH and (chunk := next(chunks, None)) is not None:
                in_flight.append((chunk, pool.submit(encode, chunk.texts, add_special_tokens=False)))
            if not in_flight:
                break
            chunk, pending = in_flight.popleft()
            flat, lens = _flatten(pending.result(), eod, chunk)
            done = sink.write(chunk, flat, lens)
            if on_progress is not None:
                on_progress(done, int(flat.shape[0]))
        if sink.documents == 0:
            raise UserError(_empty_message(recipe, stats))
        train_stats, val_stats = (dataclasses.asdict(w.finalize()) for w in (w_train, w_val))
        # documents are written in source order, so these counts map a split's documents to sources
        train_stats["documents_per_source"] = sink.per_source["train"].tolist()
        val_stats["documents_per_source"] = sink.per_source["val"].tolist()
    t_enc = time.perf_counter() - t1
    return _Pass(trained=trained, vocab=vocab, eod=eod, special={x: tok.token_to_id(x) for x in specials(recipe)},
                 dtype=np.dtype(dtype), documents=sink.documents,
                 tokens=sink.tokens, splits={"train": train_stats, "val": val_stats}, stats=stats,
                 seconds={"tokenizer": round(t_tok, 3), "encode": round(t_enc, 3)}, extremes=sink.extremes)


def _empty_message(recipe: Recipe, stats: ReadStats) -> str:
    why = []
    if stats.undecodable:
        why.append(f"{stats.undecodable} undecodable")
    if stats.too_short:
        why.append(f"{stats.too_short} shorter than data.min_chars={recipe.data.min_chars}")
    paths = ", ".join(s.path for s in recipe.data.sources)
    return f"data.sources: the corpus is empty ({paths})" + (f": all documents skipped ({'; '.join(why)})" if why else "")

