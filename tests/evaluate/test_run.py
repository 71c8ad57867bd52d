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
