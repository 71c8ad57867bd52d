"""`ncpctl eval CHECKPOINT_OR_RUN_DIR`: the defaults come from the recipe the checkpoint carries
(its `eval` section), flags win, through the real entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate.run import resolve_target

from ..conftest import run_cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox"  # eval: {tasks: [ncp_offline], limit: 5}


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """run/checkpoints/step_0000020 = the committed tiny checkpoint, run/data = the built-in
    corpus tokenized like the checkpoint's recipe (40 documents, 320-token BPE)."""
    root = tmp_path_factory.mktemp("fixture_run")
    ck = root / "run" / "checkpoints" / "step_0000020"
    shutil.copytree(FIXTURE, ck)
    (ck.parent / "latest").write_text(ck.name + "\n")
    recipe = root / "data.yaml"
    recipe.write_text(f"run: {{dir: {root / 'run'}}}\n"
                      "data: {sources: [builtin:python-stdlib], max_documents: 40, val_fraction: 0.1}\n"
                      "tokenizer: {vocab_size: 320}\n")
    r = run_cli("tokenize", str(recipe))
    assert r.returncode == 0, r.stderr
    return root / "run"


def _json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_run_dir_uses_the_checkpoint_recipes_eval_section(fixture_run: Path) -> None:
    out = _json(run_cli("eval", str(fixture_run), "--json"))
    assert out["tasks"] == ["ncp_offline"] and out["limit"] == 5 and out["batch_size"] == 8
    assert {"ncp_heldout_ppl", "ncp_cloze", "ncp_last_ident"} <= set(out["results"])
    assert Path(out["files"]["json"]).parent == fixture_run / "eval" and Path(out["files"]["json"]).is_file()


def test_flags_win_over_the_checkpoint_recipe(fixture_run: Path) -> None:
    ck = fixture_run / "checkpoints" / "step_0000020"
    out = _json(run_cli("eval", str(ck), "--tasks", "ncp_cloze", "--limit", "2", "--batch-size", "3", "--json"))
    assert out["tasks"] == ["ncp_cloze"] and out["limit"] == 2 and out["batch_size"] == 3
    assert set(out["results"]) == {"ncp_cloze"}


def test_checkpoint_without_eval_tasks_or_with_a_bad_section(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURE, ck)
    meta = json.loads((ck / "ncpctl.json").read_text())
    meta["recipe"]["eval"] = {"tasks": [], "batch_size": 8, "limit": None, "num_fewshot": 1}
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="no tasks to evaluate"):
        resolve_target(str(ck), [], None, None, None, None, None)
    t = resolve_target(str(ck), [], ["ncp_cloze"], None, None, None, None)
    assert (t.tasks, t.num_fewshot, t.batch_size, t.limit) == (["ncp_cloze"], 1, 8, None)
    meta["recipe"]["eval"] = {"tasks": ["ncp_offline"], "batch_size": 0}
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"ncpctl.json: recipe eval.batch_size"):
        resolve_target(str(ck), [], None, None, None, None, None)
    meta.pop("recipe")  # a checkpoint written without a recipe: schema defaults, so --tasks is needed
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="no tasks to evaluate"):
        resolve_target(str(ck), [], None, None, None, None, None)


# ---- ConceptLM's perplexity sets: units, the average's rule, the held-out training distribution

HELD = {"conceptlm_val_ppl": "token perplexity", "wikitext": "word perplexity",
        "lambada_openai": "target perplexity", "lambada_standard": "target perplexity"}


def test_avg_ppl_follows_the_printed_rule_and_skips_training_splits() -> None:
    """ConceptLM's four sets plus pile_10k (Pile training documents: lm-eval scores its `train`
    split): the average takes the four held-out sets, each in its own unit; the rule printed under
    the table and in the markdown names exactly those, and recomputing from it gives the average."""
    import math
    import re

    from rich.console import Console

    from ncpctl.evaluate.run import ppl_markdown, perplexity_summary, rich_table

    results = {"conceptlm_val_ppl": {"token_perplexity,none": 12.0, "word_perplexity,none": 40.0},
               "wikitext": {"word_perplexity,none": 30.0, "byte_perplexity,none": 1.9},
               "lambada_openai": {"perplexity,none": 20.0, "acc,none": 0.4},
               "lambada_standard": {"perplexity,none": 70.0, "acc,none": 0.3},
               "pile_10k": {"word_perplexity,none": 1000.0, "byte_perplexity,none": 2.5},
               "arc_easy": {"acc,none": 0.5}}
    stats = {t: {"nll": 10.0 * (i + 1), "tokens": 5 * (i + 1)} for i, t in enumerate(results)}
    configs = {**{t: {"test_split": "test"} for t in results}, "pile_10k": {"test_split": "train"},
               "wikitext": {"validation_split": "validation", "test_split": "test"}}
    p = perplexity_summary(results, stats, configs)
    assert {k: v["unit"] for k, v in p["per_set"].items()} == {**HELD, "pile_10k": "word perplexity"}
    assert p["excluded"] == ["pile_10k"] and not p["per_set"]["pile_10k"]["averaged"]
    m = re.fullmatch(r"mean_of_sets = \((.*)\) / (\d+): .*; not averaged \(scored on a training split\): pile_10k",
                     p["rule"])
    assert m, p["rule"]
    terms = dict(re.fullmatch(r"(\S+) \[(.+)\]", t).groups() for t in m.group(1).split(" + "))
    assert terms == HELD and int(m.group(2)) == len(terms)
    assert p["mean_of_sets"] == pytest.approx(sum(p["per_set"][k]["value"] for k in terms) / len(terms))
    assert p["mean_of_sets"] == pytest.approx((12 + 30 + 20 + 70) / 4)
    held = [stats[k] for k in HELD]
    assert p["token_weighted"] == pytest.approx(math.exp(sum(s["nll"] for s in held) / sum(s["tokens"] for s in held)))
    md = ppl_markdown(p)
    assert f"- rule: {p['rule']}" in md and all(f"| {k} | {u} (" in md for k, u in HELD.items())
    assert "| pile_10k | word perplexity (word_perplexity) | train | 1000.0000 | no: training split |" in md
    con = Console(record=True, width=200)
    con.print(rich_table({"checkpoint": "ck", "results": {}, "groups": {}, "perplexity": p}))
    text = con.export_text()
    assert " ".join(p["rule"].split()) in " ".join(text.split())  # the caption, however it wraps
    rows = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.count("│") >= 4}
    assert all(u in rows[k] for k, u in HELD.items()) and "training split: not averaged" in rows["pile_10k"]


def test_conceptlm_val_ppl_scores_the_checkpoints_validation_split(fixture_run: Path, tmp_path: Path) -> None:
    """The lm-eval task (offline): whole documents of run.dir/data/val, every token scored once, in
    token perplexity, averaged; data.val_prefix (the Pythia recipes' Pile validation set) wins."""
    from ncpctl.checkpoint import resolve
    from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
    from ncpctl.evaluate.offline import validation_prefix
    from ncpctl.evaluate.run import evaluate

    s = evaluate(resolve_target(str(fixture_run), [], ["conceptlm_val_ppl"], 4, 3, None, str(tmp_path / "eval")))
    v = s["perplexity"]["per_set"]["conceptlm_val_ppl"]
    assert (v["unit"], v["split"], v["averaged"], v["value"]) == (
        "token perplexity", "test", True, s["results"]["conceptlm_val_ppl"]["token_perplexity"])
    val = IndexedDataset(fixture_run / "data" / "val")
    eod = json.loads((fixture_run / "data" / "meta.json").read_text())["tokenizer"]["eod_id"]
    assert v["tokens"] == sum(len(val[i]) - (int(val[i][-1]) == eod) for i in range(3))  # the first 3 documents
    ckpt = resolve(fixture_run)
    assert validation_prefix(str(ckpt))[0] == fixture_run / "data" / "val"
    copy, pile = tmp_path / "ckpt", tmp_path / "pile" / "pile_val_text_document"
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "ncpctl.json").read_text())
    meta["recipe"]["data"]["val_prefix"] = str(pile)
    (copy / "ncpctl.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=f"data.val_prefix {pile}: no .bin/.idx"):
        validation_prefix(str(copy))
    pile.parent.mkdir()
    with IndexedDatasetWriter(pile, "uint16") as w:
        w.add_document([5, 6, 7])
    assert validation_prefix(str(copy)) == (pile, copy / "tokenizer.json")
