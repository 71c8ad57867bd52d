"""ncpctl.data.indexed: round trips, byte-level format parity with Megatron, corruption checks."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from ncpctl.errors import UserError

# Independent of the module under test: the MMIDIDX layout as Megatron-LM / GPT-NeoX write it.
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def read_megatron(prefix: Path) -> dict:
    """Minimal reader written from the format description (struct + frombuffer)."""
    idx = Path(str(prefix) + ".idx").read_bytes()
    magic = idx[:9]
    (version,) = struct.unpack_from("<Q", idx, 9)
    (code,) = struct.unpack_from("<B", idx, 17)
    n, n_doc = struct.unpack_from("<QQ", idx, 18)
    off = 34
    sizes = np.frombuffer(idx, dtype="<i4", count=n, offset=off)
    pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=off + 4 * n)
    doc_idx = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off + 12 * n)
    assert len(idx) == off + 12 * n + 8 * n_doc
    dtype = np.dtype(MEGATRON_CODES[code]).newbyteorder("<")
    data = Path(str(prefix) + ".bin").read_bytes()
    docs = [np.frombuffer(data, dtype=dtype, count=int(s), offset=int(p)) for s, p in zip(sizes, pointers)]
    return dict(magic=magic, version=version, code=code, n=n, n_doc=n_doc, sizes=sizes,
                pointers=pointers, doc_idx=doc_idx, docs=docs, bin_len=len(data))


def write_megatron(prefix: Path, docs: list[list[int]], dtype: type, code: int) -> None:
    """Minimal writer mimicking Megatron's builder: one sequence per document, end_document each."""
    itemsize = np.dtype(dtype).itemsize
    with open(str(prefix) + ".bin", "wb") as f:
        for d in docs:
            f.write(np.array(d, dtype=dtype).tobytes())
    sizes = [len(d) for d in docs]
    pointers, addr = [], 0
    for s in sizes:
        pointers.append(addr)
        addr += s * itemsize
    doc_idx = list(range(len(docs) + 1))
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(MEGATRON_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(sizes, dtype=np.int32).tobytes())
        f.write(np.array(pointers, dtype=np.int64).tobytes())
        f.write(np.array(doc_idx, dtype=np.int64).tobytes())


DOCS = [[5, 6, 7, 0], [0], [], [1, 2, 3, 4, 5, 6, 0], [5006, 0]]


def final_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_best_dtype() -> None:
    assert best_dtype(50304) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(200_000) == np.int32


@pytest.mark.parametrize("dtype,code,big", [(np.uint16, 8, 65535), (np.int32, 4, 2**31 - 1)])
def test_round_trip_and_independent_reader(tmp_path: Path, dtype: type, code: int, big: int) -> None:
    docs = DOCS + [[big, 0]]
    prefix = tmp_path / "corpus.v1"  # a dot in the prefix must not be treated as a suffix
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_document(docs[0])
        w.add_document(np.array(docs[1], dtype=np.int64))
        rest = docs[2:]
        w.add_documents(np.array([t for d in rest for t in d], dtype=np.int64),
                        np.array([len(d) for d in rest]))
    assert w.finalize().documents == len(docs)
    assert w.finalize().tokens == sum(map(len, docs))
    assert final_files(tmp_path) == ["corpus.v1.bin", "corpus.v1.idx"]

    ref = read_megatron(prefix)
    itemsize = np.dtype(dtype).itemsize
    assert ref["magic"] == MEGATRON_MAGIC and ref["version"] == 1 and ref["code"] == code
    assert ref["n"] == len(docs) and ref["n_doc"] == len(docs) + 1
    assert ref["sizes"].tolist() == [len(d) for d in docs]
    assert ref["pointers"].tolist() == (np.cumsum([0] + [len(d) for d in docs[:-1]]) * itemsize).tolist()
    assert ref["doc_idx"].tolist() == list(range(len(docs) + 1))
    assert [d.tolist() for d in ref["docs"]] == docs
    assert ref["bin_len"] == sum(map(len, docs)) * itemsize

    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(map(len, docs))
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds[-1].tolist() == docs[-1]
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert ds.sizes.tolist() == ref["sizes"].tolist()
    assert ds.pointers.tolist() == ref["pointers"].tolist()
    assert ds.doc_idx.tolist() == ref["doc_idx"].tolist()
    with pytest.raises(IndexError):
        ds[len(docs)]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_reads_megatron_written_files(tmp_path: Path, dtype: type, code: int) -> None:
    write_megatron(tmp_path / "pile", DOCS, dtype, code)
    ds = IndexedDataset(tmp_path / "pile")
    assert ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds.doc_idx.tolist() == list(range(len(DOCS) + 1))


def test_empty_dataset(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16) as w:
        pass
    assert w.finalize().documents == 0
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.doc_idx.tolist() == [0]


@pytest.mark.parametrize("bad", [65536, -1])
def test_ids_out_of_range(tmp_path: Path, bad: int) -> None:
    with pytest.raises(UserError, match=rf"token id {bad} does not fit dtype uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 2, 0])
            w.add_documents(np.array([3, bad, 0]), np.array([3]))
    assert final_files(tmp_path) == []


def test_exception_inside_writer_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "x", np.int32) as w:
            w.add_document([1, 2, 0])
            raise KeyboardInterrupt
    assert final_files(tmp_path) == []


def test_failed_rewrite_keeps_previous_files(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        w.add_document([1, 2, 0])
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([9, 9, 9, 0])
            raise RuntimeError("boom")
    assert final_files(tmp_path) == ["x.bin", "x.idx"]
    assert IndexedDataset(tmp_path / "x")[0].tolist() == [1, 2, 0]


def _written(tmp_path: Path) -> tuple[Path, Path, Path]:
    prefix = tmp_path / "c"
    write_megatron(prefix, [[1, 2, 3, 0], [4, 5, 0], [6, 0]], np.uint16, 8)
    return prefix, Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx")


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        IndexedDataset(tmp_path / "nope")
    assert e.value.problems == [f"{tmp_path / 'nope.bin'}: file not found", f"{tmp_path / 'nope.idx'}: file not found"]
    prefix, bin_, _ = _written(tmp_path)
    bin_.unlink()
    with pytest.raises(UserError, match=r"c\.bin: file not found"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("corrupt,match", [
    (lambda b, i: b.write_bytes(b.read_bytes()[:-1]), r"c\.bin: truncated \.bin"),
    (lambda b, i: b.write_bytes(b.read_bytes()[:-2]), r"c\.idx: index does not match c\.bin"),
    (lambda b, i: i.write_bytes(i.read_bytes()[:-1]), r"c\.idx: truncated \.idx"),
    (lambda b, i: i.write_bytes(i.read_bytes()[:20]), r"c\.idx: truncated \.idx"),
    (lambda b, i: _patch(i, 0, b"NOTMEGAT\x00"), r"c\.idx: not a Megatron MMIDIDX index"),
    (lambda b, i: _patch(i, 9, struct.pack("<Q", 2)), r"c\.idx: unsupported index version 2"),
    (lambda b, i: _patch(i, 17, b"\x09"), r"c\.idx: unsupported dtype code 9"),
    (lambda b, i: _patch(i, 18, struct.pack("<Q", 4)), r"c\.idx: truncated \.idx"),
    # sizes[0]: 4 -> 5; the last pointer+size still matches, the pointer chain does not
    (lambda b, i: _patch(i, 34, struct.pack("<i", 5)), r"c\.idx: sequence 1 starts at byte 8"),
    # sizes[2]: 2 -> 3; the sequences now end past the .bin
    (lambda b, i: _patch(i, 34 + 8, struct.pack("<i", 3)), r"c\.idx: index does not match c\.bin"),
    # pointers[0]: 0 -> 2
    (lambda b, i: _patch(i, 34 + 12, struct.pack("<q", 2)), r"c\.idx: first sequence pointer is 2"),
])
def test_corruption_is_a_user_error(tmp_path: Path, corrupt, match: str) -> None:
    prefix, bin_, idx = _written(tmp_path)
    IndexedDataset(prefix)  # intact files open
    corrupt(bin_, idx)
    with pytest.raises(UserError, match=match) as e:
        IndexedDataset(prefix)
    assert len(e.value.problems) == 1


def test_old_tntidx_format_gets_a_hint(tmp_path: Path) -> None:
    prefix, _, idx = _written(tmp_path)
    _patch(idx, 0, b"TNTIDX\x00\x00\x00")
    with pytest.raises(UserError) as e:
        IndexedDataset(prefix)
    assert "lazy" in (e.value.hint or "")


def test_add_documents_checks_its_arguments(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        with pytest.raises(ValueError, match="lengths sum to 4"):
            w.add_documents(np.arange(3), np.array([2, 2]))
        with pytest.raises(UserError, match="must be integers"):
            w.add_documents(np.array([1.0, 2.0]), np.array([2]))
        w.add_document([7, 0])  # the writer stays usable after a rejected batch
    assert IndexedDataset(tmp_path / "x").tokens.tolist() == [7, 0]


def test_a_document_written_in_parts(tmp_path: Path) -> None:
    """add_part: a document too long to hold whole; the same files as writing it at once."""
    doc = np.arange(1, 40, dtype=np.int64)
    with IndexedDatasetWriter(tmp_path / "whole", np.uint16) as w:
        w.add_documents(np.arange(5), np.array([5]))
        w.add_document(doc)
    with IndexedDatasetWriter(tmp_path / "parts", np.uint16) as w:
        w.add_documents(np.arange(5), np.array([5]))
        w.add_part(doc[:10], end=False)
        with pytest.raises(RuntimeError, match="a document is open"):
            w.add_documents(np.arange(2), np.array([2]))
        w.add_part(doc[10:], end=True)
        stats = w.finalize()
    assert (stats.documents, stats.tokens, stats.max_id) == (2, 44, 39)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"parts{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()
    w = IndexedDatasetWriter(tmp_path / "open", np.uint16)
    w.add_part(doc, end=False)
    with pytest.raises(RuntimeError, match="still open"):
        w.finalize()
    assert not (tmp_path / "open.bin").exists()
