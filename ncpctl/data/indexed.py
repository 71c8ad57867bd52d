"""Megatron-compatible indexed token datasets (``PREFIX.bin`` + ``PREFIX.idx``, "MMIDIDX").

The same on-disk format as Megatron-LM's and GPT-NeoX's ``MMapIndexedDataset`` (the
pre-tokenized Pile that Pythia was trained on), so files move freely between the tools.

``PREFIX.bin``: every token id of every sequence, back to back, little-endian ``dtype``.
``PREFIX.idx`` (all little-endian, packed, no padding)::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    <Q       version = 1
    <B       dtype code (see ``DTYPE_CODES``)
    <Q       n = number of sequences
    <Q       n_doc = number of document-index entries
    int32    sizes[n]      tokens per sequence
    int64    pointers[n]   byte offset of each sequence in .bin
    int64    doc_idx[n_doc] sequence index at each document boundary ([0, 1, ..., n] here)

Megatron-LM may append ``int8 modes[n]`` for multimodal data; it is ignored here.
numpy only: this module must not import torch (it runs in tokenizer workers and tests).
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Union

import numpy as np

from ncpctl.errors import UserError
from ncpctl.fsutil import commit, disk_errors

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-LM's DType enum. GPT-NeoX maps 7 to float64 too; neither is used for tokens.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
WRITE_CODES: dict[np.dtype, int] = {np.dtype("<u2"): 8, np.dtype("<i4"): 4}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n, n_doc: 34 bytes
_CHECK_CHUNK = 1 << 22  # entries per chunk when validating pointers (bounded memory on huge .idx)

PathLike = Union[str, "os.PathLike[str]"]


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room to spare (Megatron's 65500 cut-off), else int32."""
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def paths(prefix: PathLike) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``. Suffixes are appended, not substituted: prefixes may contain dots."""
    p = os.fspath(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


@dataclass(frozen=True)
class WriteStats:
    documents: int
    tokens: int
    max_id: int  # the largest id written (-1: none); meta.json keeps it, so a reader need not scan the .bin


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin``/``PREFIX.idx``; one document = one sequence, ``doc_idx = [0..n]``.

    Data goes to ``*.tmp`` files that are renamed to the final names only by a successful
    ``finalize()``/``close()``/clean ``__exit__``; an exception inside ``with`` (or ``abort()``)
    removes them, so a final name never holds a half-written file. The caller appends EOD.
    """

    def __init__(self, prefix: PathLike, dtype: np.dtype | type | str):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype not in WRITE_CODES:
            raise ValueError(f"indexed datasets are written as uint16 or int32, not {self.dtype}")
        self.bin_path, self.idx_path = paths(prefix)
        self._bin_tmp = Path(str(self.bin_path) + ".tmp")
        self._idx_tmp = Path(str(self.idx_path) + ".tmp")
        with disk_errors(self._bin_tmp):
            self.bin_path.parent.mkdir(parents=True, exist_ok=True)
            self._bin = open(self._bin_tmp, "wb")
        self._sizes = array("i")  # int32 per document; compact even for 100M+ documents
        assert self._sizes.itemsize == 4
        self._tokens = 0
        self._open = 0  # ids written so far of a document written in parts (add_part)
        self._max_seen = -1
        self._stats: WriteStats | None = None
        self._max_id = int(np.iinfo(self.dtype).max)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.dtype.kind not in "iu":
            raise UserError(f"{self.bin_path}: token ids must be integers, got dtype {ids.dtype}")
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi > self._max_id:
            bad = lo if lo < 0 else hi
            raise UserError(
                f"{self.bin_path}: token id {bad} does not fit dtype {self.dtype.name} "
                f"(valid 0..{self._max_id})",
                hint="write with dtype int32 (data.dtype: int32) or check the tokenizer's vocab_size")
        self._max_seen = max(self._max_seen, hi)

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        """Append one document (1-D ids, EOD already included by the caller)."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D array of ids, got shape {arr.shape}")
        self.add_documents(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, flat_ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: ``flat_ids`` (N,) concatenated, ``lengths`` (D,) summing to N.

        Checked before anything is written, so a rejected batch leaves the writer consistent.
        """
        if self._stats is not None or self._open:
            raise RuntimeError("writer already finalized" if self._stats is not None else "a document is open")
        flat_ids, lengths = np.asarray(flat_ids), np.asarray(lengths)
        if flat_ids.ndim != 1 or lengths.ndim != 1:
            raise ValueError(f"flat_ids and lengths must be 1-D, got {flat_ids.shape} and {lengths.shape}")
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("document lengths must be in 0..2**31-1 (the .idx stores int32 sizes)")
        if int(lengths.sum()) != flat_ids.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but flat_ids has {flat_ids.size} ids")
        self._check_ids(flat_ids)
        # One contiguous little-endian buffer per call; no per-document Python work.
        with disk_errors(self._bin_tmp):
            self._bin.write(np.ascontiguousarray(flat_ids, dtype=self.dtype).data)
        self._sizes.frombytes(lengths.astype("<i4").tobytes())
        self._tokens += flat_ids.size

    def add_part(self, ids: np.ndarray, end: bool) -> None:
        """Append ``ids`` (1-D) to a document written in parts, one too long to hold whole;
        ``end``: this part ends it (its EOD included by the caller)."""
        if self._stats is not None:
            raise RuntimeError("writer already finalized")
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"a part is a 1-D array of ids, got shape {ids.shape}")
        if self._open + ids.size > np.iinfo(np.int32).max:
            raise UserError(f"{self.bin_path}: a document of more than {np.iinfo(np.int32).max:,} tokens "
                            "(the .idx stores int32 sizes)")
        self._check_ids(ids)
        with disk_errors(self._bin_tmp):
            self._bin.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        self._tokens += ids.size
        self._open += ids.size
        if end:
            self._sizes.append(self._open)
            self._open = 0

    def finalize(self) -> WriteStats:
        """Write the index and move both files to their final names. Idempotent."""
        if self._stats is not None:
            return self._stats
        try:
            if self._open:
                raise RuntimeError("finalize with a document still open (add_part without end)")
            with disk_errors(self._bin_tmp):  # the buffered rest goes to disk here
                self._bin.close()
            sizes = np.frombuffer(self._sizes, dtype="<i4")  # (n,)
            n = sizes.size
            # pointers[i] = byte offset of sequence i = itemsize * (tokens before i); int64 math.
            pointers = np.zeros(n, dtype="<i8")
            if n > 1:
                np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            doc_idx = np.arange(n + 1, dtype="<i8")
            with open(self._idx_tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, WRITE_CODES[self.dtype], n, doc_idx.size))
                f.write(sizes.tobytes())
                f.write(pointers.tobytes())
                f.write(doc_idx.tobytes())
            # .idx last: a reader that sees the new .idx also sees the matching .bin; each is
            # fsynced before its rename, so after a crash the pair is still whole.
            commit(self._bin_tmp, self.bin_path)
            commit(self._idx_tmp, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._stats = WriteStats(documents=n, tokens=self._tokens, max_id=self._max_seen)
        return self._stats

    close = finalize

    def abort(self) -> None:
        """Drop everything written so far; final names are left untouched."""
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:  # a full disk cannot take the buffered rest: it is dropped anyway
                pass
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)


def _memmap(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    # np.memmap refuses zero-length maps (empty dataset / empty .bin).
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin``/``PREFIX.idx``, validated on open.

    ``ds[i]`` is sequence ``i`` (a view, no copy); ``tokens`` is the whole .bin as one flat
    array ``(num_tokens,)``, which is what the window reader samples from.
    """

    def __init__(self, prefix: PathLike):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = paths(prefix)
        missing = [f"{p}: file not found" for p in (self.bin_path, self.idx_path) if not p.is_file()]
        if missing:
            raise UserError(*missing, hint="an indexed dataset is a PREFIX.bin + PREFIX.idx pair; "
                            "give PREFIX without the extension")
        idx_bytes = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) >= len(MAGIC) and head[:9] != MAGIC:
            hint = ("this is the old 'lazy'/'cached' format; convert it to 'mmap' with Megatron's tools"
                    if head.startswith(b"TNTIDX") else None)
            raise UserError(f"{self.idx_path}: not a Megatron MMIDIDX index (magic {head[:9]!r}, "
                            f"expected {MAGIC!r})", hint=hint)
        if len(head) < _HEADER.size:
            raise UserError(f"{self.idx_path}: truncated .idx ({idx_bytes} bytes, the header alone is {_HEADER.size})")
        _, version, code, n, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise UserError(f"{self.idx_path}: unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise UserError(f"{self.idx_path}: unsupported dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype: np.dtype = DTYPE_CODES[code]
        need = _HEADER.size + 4 * n + 8 * n + 8 * n_doc
        if idx_bytes < need:
            raise UserError(f"{self.idx_path}: truncated .idx (header says {n} sequences and {n_doc} "
                            f"document-index entries = {need} bytes, file has {idx_bytes})")
        bin_bytes = self.bin_path.stat().st_size
        itemsize = self.dtype.itemsize
        if bin_bytes % itemsize:
            raise UserError(f"{self.bin_path}: truncated .bin ({bin_bytes} bytes is not a multiple of "
                            f"the {itemsize}-byte {self.dtype.name} items)")
        # The arrays start at unaligned offsets (34, 34+4n, ...); numpy reads them fine.
        self.sizes = _memmap(self.idx_path, np.dtype("<i4"), _HEADER.size, n)  # (n,)
        self.pointers = _memmap(self.idx_path, np.dtype("<i8"), _HEADER.size + 4 * n, n)  # (n,) bytes
        self.doc_idx = _memmap(self.idx_path, np.dtype("<i8"), _HEADER.size + 12 * n, n_doc)  # (n_doc,)
        self._check_layout(bin_bytes)
        self.num_tokens = bin_bytes // itemsize
        self.tokens = _memmap(self.bin_path, self.dtype, 0, self.num_tokens)  # (num_tokens,)

    def _check_layout(self, bin_bytes: int) -> None:
        """Sequences must tile the .bin exactly: pointers[0] = 0, each starts where the last ended."""
        n, itemsize = self.sizes.size, self.dtype.itemsize
        end = 0 if n == 0 else int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize
        if end != bin_bytes:
            raise UserError(f"{self.idx_path}: index does not match {self.bin_path.name} (sequences end at "
                            f"byte {end}, .bin has {bin_bytes} bytes)",
                            hint="the .bin and .idx come from different runs, or one was cut short")
        if n and self.pointers[0] != 0:
            raise UserError(f"{self.idx_path}: first sequence pointer is {int(self.pointers[0])}, expected 0")
        for lo in range(0, max(n - 1, 0), _CHECK_CHUNK):
            hi = min(lo + _CHECK_CHUNK, n - 1)
            expect = self.pointers[lo:hi] + self.sizes[lo:hi].astype(np.int64) * itemsize
            bad = np.flatnonzero((self.sizes[lo:hi] < 0) | (self.pointers[lo + 1:hi + 1] != expect))
            if bad.size:
                i = lo + int(bad[0])
                raise UserError(f"{self.idx_path}: sequence {i + 1} starts at byte {int(self.pointers[i + 1])} "
                                f"but sequence {i} ends at byte {int(expect[bad[0]])} (sizes/pointers corrupt)")
        if n and self.sizes[-1] < 0:
            raise UserError(f"{self.idx_path}: sequence {n - 1} has negative size {int(self.sizes[-1])}")

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sizes[i])]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype.name})")
