"""`ncpctl.data.pieces` and the streaming of one huge document (issue 21): the pieces of a cut
document encode to exactly the ids of the whole, on adversarial text and several tokenizer
pipelines; pipelines where that is not known are never cut; a 30 MB single-line document is
tokenized in bounded memory."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ncpctl.data import tokenize as tokenize_mod
from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.pieces import CL100K, QWEN2, cut_refusal, pieces
from ncpctl.recipe import load_recipe

EOD = "<|endoftext|>"
# the hard cases of the byte-level regexes: contractions, runs of spaces before words and at the
# end of lines, tabs and newlines next to spaces, digits (one at a time, by threes, runs),
# punctuation runs, letters after punctuation (one pre-token in cl100k), non-ASCII letters,
# spaces and digits, combining marks (NFC composes them), compatibility forms (NFKC), emoji, the
# EOD added token inside the text, and long runs without a space (no cut place in them)
ATOMS = ["don't", "it's", "we're", "I'M", "you'll", "'s", "'", "' t", "the", "The", " ", "  ", "   ", "\t", "\n",
         " \n", "\n ", "\r\n", "  \n\n  ", "0", "12", "123456", "3.14", "1,000", "!", "?!", "...", " .", "(x)",
         "\"q\"", "a-b", "x_y", "-->", "café", "e\u0301", "ﬁ", "Å", "ß", "日本語", "한국어", "🙂", "\u00a0", "\u3000",
         "٣", "Ⅻ", EOD, "a" * 3000, "7" * 1500, "!?" * 900, "ab1!" * 400, "\u00a0" * 50, "x y" * 30]


def adversarial(n_atoms: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ATOMS) + rng.choice(["", " ", " ", "  "]) for _ in range(n_atoms))


def trained(text: str, pre: object, normalizer: object = None, vocab: int = 600) -> Tokenizer:
    """A byte-level BPE trained on ``text`` with the given pre-tokenizer and normalizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOD], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def split_pre(pattern: str) -> object:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PIPELINES = {
    "gpt2": lambda t: trained(t, pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "gpt2-prefix-space-nfkc": lambda t: trained(t, pre_tokenizers.ByteLevel(add_prefix_space=True), normalizers.NFKC()),
    "cl100k-nfc": lambda t: trained(t, split_pre(CL100K), normalizers.NFC()),
    "qwen2": lambda t: trained(t, split_pre(QWEN2)),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_pieces_encode_exactly_like_the_whole(name: str) -> None:
    text = adversarial(1000, seed=1)
    tok = PIPELINES[name](text)
    assert cut_refusal(tok) is None
    whole = tok.encode(text, add_special_tokens=False).ids
    for size in (1, 2, 5, 64, 4096):
        parts = list(pieces(text, size))
        assert "".join(parts) == text and all(parts)
        assert all(p.startswith(" ") for p in parts[1:]) and all(p[-1] not in " \t\n" for p in parts[:-1])
        if size == 1:
            assert len(parts) > 500  # every cut place is used
        got = [i for e in tok.encode_batch(parts, add_special_tokens=False) for i in e.ids]
        assert got == whole, (name, size)
    # the harness sees a wrong cut: after a space (" the" is one pre-token) the ids change
    naive = [m.end() for m in __import__("re").finditer(r" (?=[a-z])", text)][::7]
    bounds = [0, *naive, len(text)]
    wrong = [i for a, b in zip(bounds, bounds[1:])
             for i in tok.encode(text[a:b], add_special_tokens=False).ids]
    assert wrong != whole


def test_a_run_without_a_cut_place_stays_whole() -> None:
    text = "ab" * 5000 + " tail"
    assert list(pieces(text, 10)) == [text[:10000], " tail"]  # the first cut place is after the run
    assert list(pieces("x" * 100, 10)) == ["x" * 100]


def test_pipelines_that_could_merge_across_a_cut_are_not_cut() -> None:
    text = adversarial(100, seed=2)
    assert cut_refusal(trained(text, pre_tokenizers.Metaspace())) is not None  # "▁" prepended to every piece
    assert cut_refusal(trained(text, pre_tokenizers.ByteLevel(), normalizers.Strip())) is not None
    assert cut_refusal(trained(text, split_pre(r"\s+|\S+"))) is not None  # a regex nobody checked
    assert cut_refusal(trained(text, pre_tokenizers.ByteLevel(use_regex=False))) is not None  # no split at all
    tok = trained(text, pre_tokenizers.ByteLevel())
    tok.enable_truncation(100)
    assert cut_refusal(tok) == "the tokenizer truncates or pads"
    from tokenizers import AddedToken

    for added in (AddedToken("<mask>", rstrip=True), AddedToken("<w>", single_word=True), AddedToken("a b")):
        tok = trained(text, pre_tokenizers.ByteLevel())
        tok.add_tokens([added])
        assert "may reach across a cut" in cut_refusal(tok)


def test_tokenize_writes_a_cut_document_exactly(tmp_path: Path, monkeypatch) -> None:
    """The whole pipeline on a 300 KB single-line document (cut into pieces of 4 KB in chunks of
    16 KB): the same tokenizer and the same ids as encoding it whole, EOD once at the end."""
    monkeypatch.setattr(tokenize_mod, "ENCODE_CHARS", 1 << 14)
    monkeypatch.setattr(tokenize_mod, "PIECE_CHARS", 1 << 12)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = adversarial(800, seed=3).replace("\n", " ").replace("\r", " ").replace(EOD, "eod")
    text = (text * (300_000 // len(text) + 1))[:300_000]
    (corpus / "big.txt").write_text(text)
    (corpus / "small.txt").write_text("a small document\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata: {{sources: ['{corpus}/*.txt'], val_fraction: 0.0}}\n"
                      "tokenizer: {vocab_size: 400}\n")
    r = load_recipe(recipe, need_sources=True)
    meta = tokenize_mod.tokenize(r)
    tok = Tokenizer.from_file(str(r.data_dir / "tokenizer.json"))
    monkeypatch.setattr(tokenize_mod, "ENCODE_CHARS", 1 << 30)  # the reference: nothing cut, BPE trained whole
    whole_tok = tokenize_mod.train_bpe(r, tokenize_mod.ReadStats())
    assert tok.to_str() == whole_tok.to_str()
    ds = IndexedDataset(r.data_dir / "train")
    docs = {len(ds[i]): ds[i] for i in range(len(ds))}
    big = docs[max(docs)]
    eod = meta["tokenizer"]["eod_id"]
    assert big.tolist() == tok.encode(text, add_special_tokens=False).ids + [eod]
    assert meta["splits"]["train"]["max_id"] == int(ds.tokens.max())


MEMORY = """
import json, resource, sys, time
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from ncpctl.data.tokenize import tokenize
from ncpctl.recipe import load_recipe

root = Path(sys.argv[1])
words = ["supercalifragilisticexpialidociousness", "pneumonoultramicroscopicsilicovolcanoconiosis",
         "antidisestablishmentarianism", "floccinaucinihilipilification"]
line = " ".join(words) + " "
(root / "corpus").mkdir()
(root / "corpus" / "big.txt").write_text(line * (30_000_000 // len(line)))  # one 30 MB line, one document
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([line * 20], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok.save(str(root / "tokenizer.json"))
(root / "r.yaml").write_text(f"run: {{dir: {root / 'run'}}}\\ndata: {{sources: ['{root}/corpus/*.txt'], "
                             f"val_fraction: 0.0}}\\ntokenizer: {{path: {root / 'tokenizer.json'}}}\\n")
t0 = time.perf_counter()
meta = tokenize(load_recipe(root / "r.yaml", need_sources=True))
print(json.dumps({"tokens": meta["tokens"], "seconds": time.perf_counter() - t0, "words": 4 * (30_000_000 // len(line)),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_a_30_mb_single_line_document_tokenizes_in_bounded_memory(tmp_path: Path) -> None:
    """Peak RSS of the whole process (Python, numpy, tokenizers and the 30 MB text itself)."""
    r = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["maxrss_mb"] < 1024, out
    assert out["tokens"] == out["words"] + 2  # a token per word (the BPE learned them), the last space, EOD
    ids = np.fromfile(tmp_path / "run" / "data" / "train.bin", dtype=np.uint16)  # (tokens,) EOD last
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ids.size == out["tokens"] and ids[-1] == tok.token_to_id(EOD)
    assert tok.decode(ids[:-1].tolist()) == (tmp_path / "corpus" / "big.txt").read_text()  # lossless, in order
