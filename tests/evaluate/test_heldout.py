"""Perplexity on your own held-out text (`--heldout`, `eval.heldout`): the reported numbers equal
a direct computation with the model, and a corpus with no text is one error line through the CLI."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from ncpctl.evaluate.heldout import label_of, parse_spec
from ncpctl.evaluate.run import evaluate, resolve_target

from ..conftest import run_cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox"  # 320-token BPE, debug-size model
SEQ = 16  # max_seq_len of the random models: every document below needs several rolling windows

DOCS = ["def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n",
        "class Reader:\n    def __init__(self, path):\n        self.path = path\n        self.lines = []\n"]
ROWS = ["import os\nimport sys\n\nfor name in os.listdir(sys.argv[1]):\n    print(name)\n", "", "x = 1\n"]


@pytest.fixture(scope="module", params=["concept", "base"])
def random_ckpt(request, tmp_path_factory) -> Path:
    """The committed tiny checkpoint's config and tokenizer with fresh random weights."""
    from ncpctl.checkpoint import save_model_files
    from ncpctl.model.core.config import ModelConfig
    from ncpctl.model.core.model import NCPModel

    mc = json.loads((FIXTURE / "ncpctl.json").read_text())["model_config"]
    mc = {**mc, "max_seq_len": SEQ, "concept": {**mc["concept"], "enabled": request.param == "concept"}}
    torch.manual_seed(0)
    model = NCPModel(ModelConfig.from_dict(mc)).eval()
    ck = tmp_path_factory.mktemp(f"random_{request.param}") / "ck"
    save_model_files(ck, model, step=0, tokens_seen=0, recipe=None, tokenizer_path=FIXTURE / "tokenizer.json")
    return ck


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("heldout")
    (root / "docs").mkdir()
    for i, d in enumerate(DOCS):
        (root / "docs" / f"doc{i}.txt").write_text(d)
    (root / "notes.jsonl").write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(ROWS)))
    return root


def _direct_nll(model, tok, eot: int, text: str) -> tuple[float, int]:
    """Sum of -log p over every token of ``text`` (the first predicted from the end-of-document
    token), each predicted from the at most SEQ tokens before it, in disjoint windows of SEQ
    targets — computed here with plain full forwards, not through lm-eval."""
    full = [eot] + tok.encode(text, add_special_tokens=False).ids
    n, nll = len(full) - 1, 0.0
    for s in range(0, n, SEQ):
        e = min(s + SEQ, n)
        x = torch.tensor([full[max(0, e - SEQ):e]])
        with torch.no_grad():
            logp = model(x).logits[0, -(e - s):, : model.cfg.vocab_size].log_softmax(-1)
        nll -= logp.gather(1, torch.tensor(full[s + 1 : e + 1])[:, None]).sum().item()
    return nll, n


def test_perplexities_equal_a_direct_computation(random_ckpt, corpus, tmp_path):
    from ncpctl.checkpoint import load_model
    from ncpctl.inference import eod_token

    specs = [str(corpus / "docs" / "*.txt"), f"{{path: {corpus / 'notes.jsonl'}, field: body, label: notes}}"]
    s = evaluate(resolve_target(str(random_ckpt), [], [], 3, None, None, str(tmp_path), heldout=specs))
    assert set(s["results"]) == {"heldout_docs_txt", "notes"}
    assert [h["label"] for h in s["heldout"]] == ["heldout_docs_txt", "notes"]
    loaded = load_model(random_ckpt)
    eot = eod_token(loaded)[1]
    for label, texts in (("heldout_docs_txt", DOCS), ("notes", [r for r in ROWS if r])):  # the empty row is dropped
        parts = [_direct_nll(loaded.model, loaded.tokenizer, eot, x) for x in texts]
        nll, n = sum(p[0] for p in parts), sum(p[1] for p in parts)
        assert n > 2 * SEQ  # the rolling windows are exercised
        n_bytes, n_words = sum(len(x.encode()) for x in texts), sum(len(re.split(r"\s+", x)) for x in texts)
        got = s["results"][label]
        assert got["token_perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
        assert got["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-5)
        assert got["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)
        assert got["word_perplexity"] == pytest.approx(math.exp(nll / n_words), rel=1e-5)  # lm-eval's wikitext words
        assert s["perplexity"]["per_set"][label]["tokens"] == n
    written = json.loads(Path(s["files"]["json"]).read_text())
    assert written["request"]["heldout"][1] == {"path": str(corpus / "notes.jsonl"), "field": "body", "label": "notes"}
    assert "notes" in Path(s["files"]["markdown"]).read_text()


def test_spec_syntax_labels_and_the_recipe_key(tmp_path):
    assert label_of(parse_spec("/data/notes/*.md")) == "heldout_notes_md"
    assert label_of(parse_spec("builtin:python-stdlib")) == "heldout_python_stdlib"
    spec = parse_spec("{path: a.jsonl, field: body, label: mine}")
    assert (spec.path, spec.field, label_of(spec)) == ("a.jsonl", "body", "mine")
    from ncpctl.errors import UserError

    with pytest.raises(UserError, match=r"--heldout \{path: a, fild: b\}: fild: Extra inputs"):
        parse_spec("{path: a, fild: b}")
    ck = tmp_path / "ck"  # the recipe a checkpoint carries: eval.heldout is the default, --heldout replaces it
    shutil.copytree(FIXTURE, ck)
    meta = json.loads((ck / "ncpctl.json").read_text())
    meta["recipe"]["eval"] = {"tasks": ["ncp_cloze"], "heldout": ["docs/*.txt", {"path": "x.jsonl", "label": "x"}]}
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    t = resolve_target(str(ck), [], None, None, None, None, None)
    assert t.tasks == ["ncp_cloze"] and [label_of(h) for h in t.heldout] == ["heldout_docs_txt", "x"]
    t = resolve_target(str(ck), [], [], None, None, None, None, heldout=["other.txt"])
    assert t.tasks == [] and [label_of(h) for h in t.heldout] == ["heldout_other_txt"]


def test_a_corpus_with_no_text_is_one_error_line_naming_it(tmp_path):
    """Through the real CLI: a glob that matches nothing and files that are all empty; each
    corpus gets its own line, reported together, before any model work, no results written."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.txt").write_text("  \n\n")
    none, empty = str(tmp_path / "nothing" / "*.txt"), str(tmp_path / "empty" / "*.txt")
    r = run_cli("eval", str(FIXTURE), "--tasks", "", "--heldout", none, "--heldout", empty,
                "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2 and "Traceback" not in r.stderr, r.stderr
    assert repr(none) in errors[0] and "no file matches" in errors[0]
    assert repr(empty) in errors[1] and "no text to score" in errors[1]
    assert not (tmp_path / "out").exists()
