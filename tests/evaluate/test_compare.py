"""`ncpctl eval --compare`: finished runs side by side from the results they already have (no
re-evaluation), every number of the table in --json, the union of differing task sets, a run
without results evaluated first the way the others were, and one error line for a run that has
neither results nor a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ncpctl.evaluate.compare import compare, newest_results
from ncpctl.evaluate.run import evaluate, resolve_target

from ..conftest import run_cli, run_cli_piped

TAG = "results_step_0000200.json"  # the runs fixture's checkpoints are step_0000200
HELD = "def area(r):\n    return 3.14159 * r * r\n\n\nfor r in range(3):\n    print(area(r))\n"


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("eval"))  # without results
    return dst


@pytest.fixture(scope="module")
def finished(runs, tmp_path_factory) -> dict[str, Path]:
    """Two finished runs (concept, base): evaluated on ncp_offline + a held-out file (limit 3),
    with validation records in metrics.jsonl; plus an unevaluated copy of base."""
    root = tmp_path_factory.mktemp("compare")
    (root / "held.txt").write_text(HELD)
    out = {}
    for i, kind in enumerate(("concept", "base")):
        run = _copy_run(runs[kind].parent.parent, root / kind)
        held = f"{{path: {root / 'held.txt'}, label: held}}"
        evaluate(resolve_target(str(run), [], ["ncp_offline"], 8, 3, None, None, heldout=[held]))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"split": split, "step": s, "loss": 6.0 - s / 100 + i, "ntp_loss": 5.0 - s / 100 + i}) + "\n"
            for s in (100, 200) for split in ("train", "val")))
        out[kind] = run
    out["fresh"] = _copy_run(runs["base"].parent.parent, root / "fresh")
    return out


def _results(run: Path) -> dict:
    return json.loads((run / "eval" / TAG).read_text())


def _table_rows(md: str) -> list[list[str]]:
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| task | metric |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_compare_finished_runs_without_reevaluating(finished, tmp_path):
    a, b = finished["concept"], finished["base"]
    before = {f: f.stat().st_mtime_ns for run in (a, b) for f in (run / "eval").glob("results_*")}
    r = run_cli("eval", "--compare", str(a), str(b), "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["mode"] == "compare" and [x["label"] for x in got["runs"]] == ["concept", "base"]
    assert not any(x["evaluated"] for x in got["runs"])  # nothing evaluated, nothing rewritten
    assert {f: f.stat().st_mtime_ns for run in (a, b) for f in (run / "eval").glob("results_*")} == before
    files = got["files"]
    assert Path(files["json"]).parent == tmp_path and Path(files["json"]).name == "compare_base.json"
    assert Path(files["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads(Path(files["json"]).read_text())
    assert on_disk["rows"] == got["rows"] and on_disk["runs"] == got["runs"]

    rows = {(x["task"], x["metric"]): x for x in got["rows"]}
    ra, rb = _results(a), _results(b)
    for task, metric in (("ncp_heldout_ppl", "token_perplexity"), ("ncp_cloze", "acc"), ("held", "bits_per_byte")):
        va, vb = ra["results"][task][f"{metric},none"], rb["results"][task][f"{metric},none"]
        assert rows[task, metric]["values"] == {"concept": va, "base": vb}
        assert rows[task, metric]["delta"]["base"] == pytest.approx(vb - va, abs=1e-12)
    for key in ("mean_of_sets", "token_weighted"):  # both perplexity averages, from each run's own results
        row = rows["perplexity sets", key]
        assert row["values"] == {"concept": ra["perplexity"][key], "base": rb["perplexity"][key]}
        assert row["delta"]["base"] == pytest.approx(rb["perplexity"][key] - ra["perplexity"][key], abs=1e-12)
    # every number of the markdown table is in --json (same rows, same values at 4 decimals)
    table = _table_rows(Path(files["markdown"]).read_text())
    assert [(c[0], c[1]) for c in table] == [(x["task"], x["metric"]) for x in got["rows"]]
    f = lambda v, sign="": "" if v is None else format(v, sign + ".4f")  # noqa: E731
    for cells, x in zip(table, got["rows"]):  # value, ± stderr (issue 28 item 5), then Δ
        err = x.get("stderr") or {}
        assert cells[2:] == [f(x["values"]["concept"]), f(err.get("concept")), f(x["values"]["base"]),
                             f(err.get("base")), f(x["delta"]["base"], "+")]
    assert any(c[3] for c in table)  # the stderr column is filled where lm-eval gives one
    assert got["val_loss"]["base"] == {"key": "ntp_loss", "steps": [100, 200], "values": [5.0, 4.0]}


def test_compare_loads_no_model(finished, tmp_path):
    """Results exist: the comparison never imports torch or lm-eval (so no checkpoint is loaded)."""
    code = ("import sys; from ncpctl.evaluate.compare import compare; "
            f"compare([{str(finished['concept'])!r}, {str(finished['base'])!r}], out={str(tmp_path)!r}); "
            "assert 'torch' not in sys.modules and 'lm_eval' not in sys.modules, 'imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_union_of_task_sets_and_the_newest_results_file(finished, tmp_path):
    """A run evaluated without ncp_cloze: blank cells, named in `missing` and a note. Its eval/ also
    holds an older step's results written later: the highest step wins, not the newest file."""
    partial = tmp_path / "partial" / "eval"
    partial.mkdir(parents=True)
    res = _results(finished["base"])
    res["results"].pop("ncp_cloze")
    (partial / TAG).write_text(json.dumps(res))
    older = dict(res, results={"ncp_cloze": {"acc,none": 0.99}})
    (partial / "results_step_0000100.json").write_text(json.dumps(older))
    os.utime(partial / TAG, (1, 1))
    assert newest_results(partial) == partial / TAG
    got = compare([str(finished["concept"]), str(partial.parent)], out=str(tmp_path / "out"))
    row = next(x for x in got["rows"] if (x["task"], x["metric"]) == ("ncp_cloze", "acc"))
    assert row["values"]["partial"] is None and row["delta"]["partial"] is None
    assert row["values"]["concept"] == _results(finished["concept"])["results"]["ncp_cloze"]["acc,none"]
    assert got["missing"] == {"partial": ["ncp_cloze"]}
    assert any("partial: no ncp_cloze" in n for n in got["notes"])
    md = Path(got["files"]["markdown"]).read_text()
    assert any(c[:2] == ["ncp_cloze", "acc"] and c[4:] == ["", "", ""] for c in _table_rows(md))  # value, ±, Δ blank


def test_a_run_without_results_is_evaluated_like_the_others(finished, tmp_path):
    """`fresh` (a checkpoint, no results): evaluated first on the tasks, held-out corpora and limit
    recorded in concept's results; its results land in its own eval/ for the next comparison."""
    lines = []
    got = compare([str(finished["concept"]), str(finished["fresh"])], out=str(tmp_path), log=lines.append)
    fresh = got["runs"][1]
    assert fresh["evaluated"] and fresh["results_file"] == str(finished["fresh"] / "eval" / TAG)
    asked, done = _results(finished["concept"])["request"], _results(finished["fresh"])["request"]
    assert (done["tasks"], done["heldout"], done["limit"]) == (asked["tasks"], asked["heldout"], 3)
    assert any("fresh: no eval results; evaluating" in ln and "ncp_offline, held " in ln for ln in lines), lines
    assert {(x["task"], x["metric"]) for x in got["rows"]} >= {("held", "token_perplexity")}
    assert got["missing"] == {}


def test_a_run_with_neither_results_nor_checkpoint_is_one_error_line(finished, tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_cli("eval", "--compare", str(finished["concept"]), str(tmp_path / "empty"))
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(tmp_path / "empty") in errors[0] and "no checkpoint" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_the_table_says_how_each_average_is_made(finished, tmp_path):
    """A note gives the rule the runs' perplexity average follows (its sets, each with its unit);
    a results file written before rules were recorded gets one from its per-set metrics."""
    rule = _results(finished["concept"])["perplexity"]["rule"]
    assert rule.startswith("mean_of_sets = (ncp_heldout_ppl [token perplexity] + held [token perplexity]) / 2")
    got = compare([str(finished["concept"]), str(finished["base"])], out=str(tmp_path / "a"))
    assert f"perplexity averages: {rule}" in got["notes"]
    assert f"- perplexity averages: {rule}" in Path(got["files"]["markdown"]).read_text()
    old = tmp_path / "old" / "eval"
    old.mkdir(parents=True)
    res = _results(finished["base"])
    res["perplexity"].pop("rule")
    (old / TAG).write_text(json.dumps(res))
    got = compare([str(finished["concept"]), str(old.parent)], out=str(tmp_path / "b"))
    assert f"concept: {rule}" in got["notes"]
    assert "old: mean_of_sets = (ncp_heldout_ppl [token_perplexity] + held [token_perplexity]) / 2" in got["notes"]


def test_the_markdown_names_results_files_relative_to_the_working_directory(tmp_path, monkeypatch):
    """Issue 28 item 8: docs/replication.md carried the absolute paths of the machine it ran on."""
    from ncpctl.evaluate.compare import markdown

    monkeypatch.chdir(tmp_path)
    inside, outside = tmp_path / "runs" / "a" / "eval" / "results.json", "/elsewhere/results.json"
    payload = {"runs": [{"label": "a", "results_file": str(inside), "limit": None, "evaluated": False},
                        {"label": "b", "results_file": outside, "limit": None, "evaluated": False}],
               "baseline": "a", "rows": [], "notes": []}
    md = markdown(payload)
    assert "| a | runs/a/eval/results.json |" in md and str(tmp_path) not in md
    assert f"| b | {outside} |" in md


def test_no_document_carries_a_machine_path():
    """The repository's documents name paths relative to it (a results table once carried /work/...)."""
    import re
    import subprocess

    from tests.conftest import REPO

    files = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert len(files) > 5
    bad = [f for f in files if re.search(r"(?<![\w.])/(work|root|home)/\w", (REPO / f).read_text(errors="replace"))]
    assert not bad, bad


def test_the_git_hash_lookup_is_quiet_outside_a_repository(tmp_path, monkeypatch, capfd):
    """Issue 28 item 8: every eval printed git's 'fatal: not a git repository' (lm-eval's
    ``git describe`` of the working directory lets git's stderr through)."""
    from lm_eval import evaluator

    from ncpctl.evaluate.run import _quiet_git_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    original = evaluator.get_git_commit_hash
    original()
    assert "not a git repository" in capfd.readouterr().err  # lm-eval's own lookup: the noise
    with _quiet_git_hash():
        assert evaluator.get_git_commit_hash is not original and evaluator.get_git_commit_hash() is None
    assert "not a git repository" not in capfd.readouterr().err
    assert evaluator.get_git_commit_hash is original


def test_compare_states_each_runs_budget_and_size_and_prints_whole_when_piped(finished, tmp_path):
    """Issue 28 item 5: runs of different budgets are compared with a note giving each run's tokens,
    parameters and training FLOPs (from its checkpoint, no model loaded); piped, the terminal table
    keeps its stderr column and its task names whole."""
    import json as _json

    from ncpctl.checkpoint import META

    a, b = finished["concept"], finished["base"]
    got = compare([str(a), str(b)], out=str(tmp_path / "o"))
    runs = {r["label"]: r for r in got["runs"]}
    for lab, run in (("concept", a), ("base", b)):
        ck = next((run / "checkpoints").glob("step_*"))
        meta = _json.loads((ck / META).read_text())
        assert runs[lab]["tokens"] == meta["tokens_seen"] > 0 and runs[lab]["training_flops"] > 0
    assert runs["concept"]["parameters"] > runs["base"]["parameters"] > 0  # the concept path's layers
    note = next(n for n in got["notes"] if n.startswith("the runs differ in budget or size"))
    assert f"{runs['base']['parameters']:,} parameters" in note
    # issue 46 item 4: as from a user's shell (no COLUMNS, TERM=xterm, stdout a pipe)
    r = run_cli_piped("eval", "--compare", str(a), str(b), "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ncp_heldout_ppl" in r.stdout and "ncp_last_ident" in r.stdout and "±" in r.stdout
    assert "…" not in r.stdout and max(len(line) for line in r.stdout.splitlines()) > 80, r.stdout


def test_compare_reads_the_flops_a_checkpoint_records_it_spent(finished, tmp_path):
    """A checkpoint whose metadata records the loop's FLOPs (``budget.flops``: steps x its accounting,
    a frozen stage's backward as run) is reported with that number, not a recomputation."""
    import json as _json
    import shutil as _shutil

    from ncpctl.checkpoint import META

    run = _shutil.copytree(finished["base"], tmp_path / "recorded", symlinks=True)
    ck = next((run / "checkpoints").glob("step_*"))
    meta = _json.loads((ck / META).read_text())
    meta["budget"] = {"kind": "steps", "value": 200, "max_steps": 200, "flops": 1234567.0, "tokens": meta["tokens_seen"]}
    (ck / META).write_text(_json.dumps(meta))
    got = compare([str(finished["base"]), str(run)], out=str(tmp_path / "o"))
    runs = {r["label"]: r for r in got["runs"]}
    assert runs["recorded"]["training_flops"] == 1234567.0 and runs["base"]["training_flops"] != 1234567.0


def _curved(finished, tmp_path) -> tuple[Path, Path]:
    """Copies of base and concept with known curves: tokens = 1000 x step; the baseline's val loss
    5 - t/1000 (final 1.0 at 4000 tokens), the other's 5 - 2t/1000 logged at steps 1 and 3 only
    (it crosses 1.0 at t = 2000 between them: ratio 0.5 by interpolation); train loss = step."""
    a, b = (shutil.copytree(finished[k], tmp_path / k, symlinks=True) for k in ("base", "concept"))
    for run, slope, vsteps in ((a, 1, (1, 2, 3, 4)), (b, 2, (1, 3))):
        recs = [{"split": "train", "step": s, "tokens": 1000 * s, "loss": float(s)} for s in (1, 2, 3, 4)]
        recs += [{"split": "val", "step": s, "ntp_loss": 5 - slope * s} for s in vsteps]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return a, b


def test_compare_tokens_to_reach_and_windows(finished, tmp_path):
    a, b = _curved(finished, tmp_path)
    p = compare([str(a), str(b)], out=str(tmp_path / "out"), window=2)
    base, other = (p["curves"][r["label"]] for r in p["runs"])
    assert other["target_loss"] == pytest.approx(1.0)
    assert other["tokens_to_reach"] == pytest.approx(2000) and other["tokens_ratio"] == pytest.approx(0.5)
    assert base["tokens_ratio"] == pytest.approx(1.0)
    r0, r1 = p["runs"]
    assert other["compute_ratio"] == pytest.approx(r1["training_flops"] / r1["tokens"] * 2000 / r0["training_flops"])
    assert other["train_loss_last"] == pytest.approx((3 + 4) / 2) and other["train_loss_all"] == pytest.approx(2.5)
    md = Path(p["files"]["markdown"]).read_text()
    assert "tokens to reach" in md and "ratio 0.500" in md


def test_compare_refuses_different_tokenizers(finished, tmp_path):
    from ncpctl.checkpoint import TOKENIZER, resolve

    a, b = _curved(finished, tmp_path)
    tok = resolve(b) / TOKENIZER
    assert tok.is_file()
    tok.write_text(tok.read_text() + " ")  # another tokenizer file
    r = run_cli("eval", "--compare", str(a), str(b), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "different tokenizers" in r.stderr and "Traceback" not in r.stderr
