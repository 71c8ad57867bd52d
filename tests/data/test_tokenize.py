"""`ncpctl tokenize`: output layout and format, determinism, no-op re-runs, interruption
safety, and bad input (undecodable bytes, empty corpus, wrong fields)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.tokenize import tokenize
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe

from ..conftest import ncpctl_cmd, run_cli


def recipe_file(tmp_path: Path, sources: str, extra: str = "", run: str = "run") -> Path:
    p = tmp_path / f"{run}.yaml"
    p.write_text(f"run: {{dir: {tmp_path / run}}}\ndata: {{sources: {sources}, val_fraction: 0.2}}\n"
                 f"tokenizer: {{vocab_size: 300}}\n{extra}")
    return p


def test_text_corpus_layout_format_and_round_trip(tmp_path: Path, text_corpus: Path) -> None:
    r = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']"), need_sources=True)
    meta = tokenize(r)
    data = tmp_path / "run" / "data"
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json", "meta.json", "recipe.resolved.yaml"):
        assert (data / name).is_file(), name
    assert (tmp_path / "run" / "recipe.resolved.yaml").is_file()
    assert not list((tmp_path / "run").glob(".data.*"))  # no temp leftovers
    on_disk = json.loads((data / "meta.json").read_text())
    assert on_disk["documents"] == 24 and meta["documents"] == 24
    assert on_disk["splits"]["train"]["documents"] + on_disk["splits"]["val"]["documents"] == 24
    assert on_disk["splits"]["val"]["documents"] > 0
    assert on_disk["dtype"] == "uint16" and on_disk["tokenizer"]["trained"] is True
    import hashlib

    assert on_disk["tokenizer"]["sha256"] == hashlib.sha256((data / "tokenizer.json").read_bytes()).hexdigest()
    assert len(on_disk["source_fingerprint"]) == 64 and on_disk["tokens"] == sum(
        on_disk["splits"][s]["tokens"] for s in ("train", "val"))

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    eod = on_disk["tokenizer"]["eod_id"]
    assert tok.get_vocab_size() <= 300
    texts = {p.read_text() for p in text_corpus.glob("*.txt")}
    decoded = set()
    for split in ("train", "val"):
        ds = IndexedDataset(data / split)
        assert ds.dtype == np.uint16
        assert ds.num_tokens == on_disk["splits"][split]["tokens"]
        for i in range(len(ds)):
            doc = ds[i]
            assert doc[-1] == eod and eod not in doc[:-1]  # one EOD, at the end of every document
            decoded.add(tok.decode(doc[:-1].tolist(), skip_special_tokens=False))
    assert decoded == texts  # lossless byte-level BPE: every document comes back exactly


def test_deterministic_and_noop_rerun(tmp_path: Path, text_corpus: Path) -> None:
    a = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']", run="a"), need_sources=True)
    b = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']", run="b"), need_sources=True)
    assert tokenize(a)["up_to_date"] is False
    tokenize(b)
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json"):
        assert (a.data_dir / name).read_bytes() == (b.data_dir / name).read_bytes(), name

    stamp = (a.data_dir / "train.bin").stat().st_mtime_ns
    again = tokenize(a)
    assert again["up_to_date"] is True
    assert (a.data_dir / "train.bin").stat().st_mtime_ns == stamp  # nothing rewritten

    # a changed input file re-tokenizes
    f = text_corpus / "doc03.txt"
    f.write_text(f.read_text() + "more text\n")
    assert tokenize(a)["up_to_date"] is False
    # a corrupted output is detected and rebuilt rather than trusted
    with open(a.data_dir / "train.bin", "r+b") as fh:
        fh.truncate(10)
    assert tokenize(a)["up_to_date"] is False
    assert IndexedDataset(a.data_dir / "train").num_tokens > 5


def test_undecodable_files_are_skipped_and_counted(tmp_path: Path, text_corpus: Path) -> None:
    (text_corpus / "bad1.txt").write_bytes(b"valid start \xff\xfe invalid utf-8")
    (text_corpus / "bad2.txt").write_bytes(b"\xc3\x28")
    p = recipe_file(tmp_path, f"['{text_corpus}/*.txt']")
    r = run_cli("tokenize", str(p), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["skipped"]["undecodable"] == 2 and out["documents"] == 24
    assert "skipped 2 documents with undecodable" in r.stderr


def test_empty_and_missing_corpus_are_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_bytes(b"\xff\xff")
    r = run_cli("tokenize", str(recipe_file(tmp_path, f"['{empty}/*.txt']")))
    assert r.returncode == 2
    assert "the corpus is empty" in r.stderr and "1 undecodable" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "data").exists()
    r = run_cli("tokenize", str(recipe_file(tmp_path, f"['{tmp_path}/nothing/*.txt']")))
    assert r.returncode == 2 and "no file matches" in r.stderr


def test_jsonl_and_parquet_sources_through_datasets(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"content": f"line {i} " + "alpha beta gamma " * (i % 7 + 1), "id": i} for i in range(40)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    srcs = f"[{{path: '{tmp_path}/c.jsonl', field: content}}, {{path: '{tmp_path}/c.parquet', field: content}}]"
    r = load_recipe(recipe_file(tmp_path, srcs), need_sources=True)
    meta = tokenize(r)
    assert meta["documents"] == 80
    # a missing field is named, with the fields that exist
    bad = load_recipe(recipe_file(tmp_path, f"['{tmp_path}/c.jsonl']", run="bad"), need_sources=True)
    with pytest.raises(UserError, match="no field 'text' \\(fields: content, id\\)"):
        tokenize(bad)


def test_unreachable_hub_dataset_is_one_line_error(tmp_path: Path) -> None:
    r = run_cli("tokenize", str(recipe_file(tmp_path, "['hf:some-org/some-dataset']")))
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "some-org/some-dataset" in errors[0] and "Traceback" not in r.stderr


def test_existing_tokenizer_is_loaded_and_saved(tmp_path: Path, text_corpus: Path) -> None:
    first = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']", run="first"), need_sources=True)
    tokenize(first)
    tok_path = first.data_dir / "tokenizer.json"
    second = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']", run="second"),
                         [f"tokenizer.path={tok_path}"], need_sources=True)
    meta = tokenize(second)
    assert meta["tokenizer"]["trained"] is False
    assert (second.data_dir / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert (second.data_dir / "train.bin").read_bytes() == (first.data_dir / "train.bin").read_bytes()
    with pytest.raises(UserError, match="eod_token"):
        tokenize(load_recipe(second.path, [f"tokenizer.path={tok_path}", "tokenizer.eod_token=<eos>",
                                           f"run.dir={tmp_path / 'third'}"], need_sources=True))


def test_builtin_stdlib_corpus(tmp_path: Path) -> None:
    p = recipe_file(tmp_path, "[builtin:python-stdlib]")
    r = load_recipe(p, ["data.max_documents=40"], need_sources=True)
    meta = tokenize(r)
    assert meta["documents"] + meta["skipped"]["too_short"] == 40
    assert meta["tokens"] > 10_000


def _wait_for(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path: Path, text_corpus: Path) -> None:
    """kill -9 in the middle of encoding: no data/ appears; a previous dataset stays intact;
    the next run cleans up and completes."""
    big = tmp_path / "big"
    big.mkdir()
    words = [f"w{i}" for i in range(5000)]
    rng = np.random.default_rng(0)
    for i in range(1500):
        (big / f"{i:05d}.txt").write_text(" ".join(rng.choice(words, 400)))
    p = recipe_file(tmp_path, f"['{big}/*.txt']")
    run_dir = tmp_path / "run"

    def kill_mid_encode() -> None:
        proc = subprocess.Popen([*ncpctl_cmd(), "tokenize", str(p), "--set", "data.batch_documents=16", "--force"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            grew = _wait_for(lambda: any(f.stat().st_size > 0 for f in run_dir.glob(".data.tmp-*/train.bin.tmp")), 120)
            assert grew, "encoding never started"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    kill_mid_encode()
    assert not (run_dir / "data").exists()
    assert list(run_dir.glob(".data.tmp-*"))  # the partial work is only in the temp dir

    # a complete dataset, then another interrupted run: the old dataset is untouched
    r = run_cli("tokenize", str(p))
    assert r.returncode == 0, r.stderr
    assert not list(run_dir.glob(".data.*"))  # stale temp dir of the killed run removed
    before = {f.name: f.read_bytes() for f in (run_dir / "data").iterdir()}
    kill_mid_encode()
    after = {f.name: f.read_bytes() for f in (run_dir / "data").iterdir()}
    assert before == after
    r = run_cli("tokenize", str(p), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["up_to_date"] is True


def test_large_vocab_is_written_as_int32(tmp_path: Path, text_corpus: Path) -> None:
    """A loaded tokenizer with >= 65500 tokens switches the .bin to int32 (Megatron's rule),
    and ids above 65535 round-trip."""
    from tokenizers import models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, 70000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (text_corpus / "high.txt").write_text("t69999 t65536 t3")
    r = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']"),
                    [f"tokenizer.path={tmp_path / 'big.json'}", "data.val_fraction=0.0"], need_sources=True)
    meta = tokenize(r)
    assert meta["dtype"] == "int32" and meta["tokenizer"]["vocab_size"] == 70000
    ds = IndexedDataset(r.data_dir / "train")
    assert ds.dtype == np.int32
    assert [69999, 65536, 3, 0] in [ds[i].tolist() for i in range(len(ds))]


def _docs(root: Path, n: int) -> Path:
    """``n`` small text documents doc00.txt.. (the sorted order is the document index)."""
    root.mkdir()
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(f"# document {i}\n" + f"value_{i} = {i} * {i + 1}\n" * (5 + i % 4))
    return root


def _val_texts(data: Path) -> list[str]:
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    ds = IndexedDataset(data / "val")
    return [tok.decode(ds[i][:-1].tolist(), skip_special_tokens=False) for i in range(len(ds))]


def test_small_corpus_keeps_one_validation_document(tmp_path: Path, monkeypatch) -> None:
    """17 documents at val_fraction 0.02: the hash puts none in validation; the document the hash
    came closest to putting there (index 16 with the default seed) is moved, deterministically,
    and everything written is fsynced before data/ is renamed into place."""
    from ncpctl.data.tokenize import _is_val, _uniform

    corpus = _docs(tmp_path / "c17", 17)
    assert not _is_val(np.arange(17), 1234, 0.02).any()  # the premise: the hash alone gives no validation
    lowest = int(np.argmin(_uniform(np.arange(17), 1234)))
    synced: set[tuple[int, int]] = set()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add((os.fstat(fd).st_dev, os.fstat(fd).st_ino)), real(fd)))
    metas = []
    for run in ("a", "b"):
        r = load_recipe(recipe_file(tmp_path, f"['{corpus}/*.txt']", run=run), ["data.val_fraction=0.02"],
                        need_sources=True)
        metas.append(tokenize(r))
    a, b = (tmp_path / run / "data" for run in ("a", "b"))
    assert metas[0]["splits"]["train"]["documents"] == 16 and metas[0]["splits"]["val"]["documents"] == 1
    assert metas[0]["split"]["moved_to_val"] == lowest == 16
    assert _val_texts(a) == [(corpus / f"doc{lowest:02d}.txt").read_text()]
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name  # deterministic
    on_disk = [a / n for n in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json", "meta.json")]
    assert {(p.stat().st_dev, p.stat().st_ino) for p in [*on_disk, a, a.parent]} <= synced


def test_two_documents_get_one_each_and_one_document_is_still_an_error(tmp_path: Path) -> None:
    corpus = _docs(tmp_path / "c2", 2)
    r = load_recipe(recipe_file(tmp_path, f"['{corpus}/*.txt']", run="two"), ["data.val_fraction=0.9"],
                    need_sources=True)
    meta = tokenize(r)  # the hash puts both in validation: the one nearest the boundary goes to train
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (1, 1)
    assert meta["split"]["moved_to_train"] is not None
    one = tmp_path / "c1"
    one.mkdir()
    (one / "only.txt").write_text((corpus / "doc00.txt").read_text())
    for frac, msg in (("0.02", "the validation split is empty"), ("0.9", "all 1 documents went to validation")):
        r = load_recipe(recipe_file(tmp_path, f"['{one}/*.txt']", run=f"one{frac}"), [f"data.val_fraction={frac}"],
                        need_sources=True)
        with pytest.raises(UserError, match=msg):
            tokenize(r)


def test_a_hash_split_with_both_splits_non_empty_is_unchanged(tmp_path: Path, text_corpus: Path) -> None:
    """Existing datasets are not re-split: where the hash gives documents to both splits,
    exactly the hash's validation documents are validation (checked on a real run and on the
    rule itself over many corpus sizes and fractions)."""
    from ncpctl.data.tokenize import Split, _Extremes, _is_val

    r = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt']"), need_sources=True)
    meta = tokenize(r)
    want = _is_val(np.arange(24), r.data.split_seed, r.data.val_fraction)
    assert meta["split"] == {"val_fraction": 0.2, "split_seed": 1234, "moved_to_val": None, "moved_to_train": None}
    files = sorted(text_corpus.glob("*.txt"))
    assert sorted(_val_texts(r.data_dir)) == sorted(files[i].read_text() for i in np.flatnonzero(want))
    for n in (2, 3, 5, 17, 50, 200):
        for frac in (0.01, 0.02, 0.1, 0.5, 0.9):
            idx = np.arange(n)
            val = _is_val(idx, 1234, frac)
            ext = _Extremes()
            for part in np.array_split(idx, 3):  # any chunking
                if part.size:
                    ext.see(part, val[part], 1234)
            moved = ext.rebalanced(Split(1234, frac), int((~val).sum()), int(val.sum()))
            assert (moved is None) == (0 < val.sum() < n), (n, frac)


def test_documents_per_source_map_each_split_back_to_its_sources(tmp_path: Path, text_corpus: Path) -> None:
    """meta.json counts each split's documents per data.sources entry (they are written in source
    order), which is what per-source validation metrics read: decoding the split's documents in
    order, the first counts[0] are the first source's and the rest the second's."""
    other = tmp_path / "other"
    other.mkdir()
    for i in range(10):
        (other / f"note{i}.md").write_text(f"zebra note {i}: " + "quiet harbour lights " * (30 + i) + "\n")
    r = load_recipe(recipe_file(tmp_path, f"['{text_corpus}/*.txt', '{other}/*.md', '{other}/*.md']"),
                    need_sources=True)
    meta = tokenize(r)
    assert meta["source_labels"] == ["corpus_txt", "other_md", "other_md_2"]
    data = tmp_path / "run" / "data"
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    seen = {"corpus": 0, "other": 0}
    for split in ("train", "val"):
        counts = meta["splits"][split]["documents_per_source"]
        ds = IndexedDataset(data / split)
        assert len(counts) == 3 and sum(counts) == len(ds) == meta["splits"][split]["documents"]
        kinds = ["corpus" if tok.decode(ds[i].tolist()).startswith("# document") else "other" for i in range(len(ds))]
        assert kinds == ["corpus"] * counts[0] + ["other"] * (counts[1] + counts[2]), split
        seen["corpus"] += counts[0]
        seen["other"] += counts[1] + counts[2]
    assert seen == {"corpus": 24, "other": 20}


def test_an_up_to_date_run_does_not_report_a_rate_as_measured_now():
    """Issue 28 item 8: a cached tokenize printed the old run's tokens/s as if it had just encoded."""
    from rich.console import Console

    from ncpctl.data.tokenize_command import human as _human

    meta = {"splits": {"train": {"documents": 3, "tokens": 99}}, "dtype": "uint16", "tokens_per_second": 1234,
            "tokenizer": {"vocab_size": 512, "trained": True, "eod_id": 0}}
    for up_to_date, want in ((False, "1,234 tokens/s"), (True, "nothing encoded now (written at 1,234 tokens/s)")):
        con = Console(record=True, width=200)
        _human(con, "data", {**meta, "up_to_date": up_to_date})
        text = con.export_text()
        assert want in text and (up_to_date or "nothing encoded" not in text)
