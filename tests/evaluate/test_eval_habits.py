"""What lm-eval users reach for in `ncpctl eval` (issue 47 items 1-4): logged samples that `--compare`
reads back, results that accumulate across task sets, seeds / generation settings / fractional limits
recorded and flagged, and a request cache that resumes an interrupted evaluation (model calls counted)
and never serves a changed checkpoint. On the shared debug runs (`runs` fixture), in-process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate import settings
from ncpctl.evaluate.compare import compare
from ncpctl.evaluate.run import evaluate, resolve_target

from ..conftest import run_cli


def _run_copy(runs, kind: str, dst: Path) -> Path:
    """A run directory with the fixture's checkpoint and data, without its eval/ (results of its own)."""
    src = runs[kind].parent.parent
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("eval"))
    return dst


def _target(run: Path, tasks: list[str], limit, batch: int = 4, **kw):
    return resolve_target(str(run), [], tasks, batch, limit, None, None, **kw)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_logged_samples_are_written_and_read_back_by_compare(runs, tmp_path: Path) -> None:
    a, b = (_run_copy(runs, k, tmp_path / k) for k in ("concept", "base"))
    for run in (a, b):
        s = evaluate(_target(run, ["ncp_cloze", "ncp_last_ident"], 6, log_samples=True))
    res = json.loads((b / "eval" / "results_step_0000200.json").read_text())
    assert set(res["samples"]) == {"ncp_cloze", "ncp_last_ident"} and not res["per_example"]  # not kept twice
    cloze = _lines(b / "eval" / res["samples"]["ncp_cloze"])
    assert [r["doc_id"] for r in cloze] == list(range(6))
    for r in cloze:  # the prompt, the chosen option (the highest log-likelihood), the target, each metric
        assert r["prompt"] and len(r["prompt_hash"]) == 64 and r["prompt_chars"] == len(r["prompt"])
        assert r["choice"] == max(range(4), key=r["loglikelihoods"].__getitem__) and r["response"]
        assert set(r["scores"]) == {"acc", "acc_norm"} and r["scores"]["acc"] == float(r["choice"] == r["target"])
    assert sum(r["scores"]["acc"] for r in cloze) / 6 == pytest.approx(s["results"]["ncp_cloze"]["acc"])
    ident = _lines(b / "eval" / res["samples"]["ncp_last_ident"])
    assert all(isinstance(r["response"], str) and r["filter"] == "first_identifier" for r in ident)
    # --compare's seed arms (one run each: "B," is an arm) pair on the logged scores: flip one example's
    # acc in b's file and the paired difference moves by 1/6
    def arm_diff() -> dict:
        got = compare([str(a), f"{b},"], out=str(tmp_path / "cmp"), resamples=200)
        return next(r for r in got["arms"]["rows"] if (r["task"], r["metric"]) == ("ncp_cloze", "acc"))["diff"][0]

    before = arm_diff()
    assert before["bootstrap"]["n"] == 6
    cloze[0]["scores"]["acc"] = 1.0 - cloze[0]["scores"]["acc"]
    (b / "eval" / res["samples"]["ncp_cloze"]).write_text("".join(json.dumps(r) + "\n" for r in cloze))
    step = arm_diff()["bootstrap"]["diff"] - before["bootstrap"]["diff"]
    assert step == pytest.approx((1 if cloze[0]["scores"]["acc"] else -1) / 6)


def test_results_accumulate_and_a_rescore_replaces_only_its_task(runs, tmp_path: Path) -> None:
    run = _run_copy(runs, "concept", tmp_path / "run")
    first = evaluate(_target(run, ["ncp_cloze"], 4))
    second = evaluate(_target(run, ["ncp_last_ident"], 4))
    assert first["files"]["json"] == second["files"]["json"] and second["kept"] == ["ncp_cloze"]
    f = Path(second["files"]["json"])
    res = json.loads(f.read_text())
    assert {"ncp_cloze", "ncp_last_ident"} <= set(res["results"]) and res["request"]["tasks"] == ["ncp_cloze",
                                                                                                  "ncp_last_ident"]
    assert res["scored"]["ncp_cloze"]["settings"]["limit"] == 4 and res["scored"]["ncp_cloze"]["date"]
    ident = {k: res[k]["ncp_last_ident"] for k in ("results", "scored", "per_example", "configs")}
    evaluate(_target(run, ["ncp_cloze"], 6, seed=(5, 5, 5, 5)))  # re-scored: only ncp_cloze changes
    res = json.loads(f.read_text())
    assert {k: res[k]["ncp_last_ident"] for k in ident} == ident
    assert res["scored"]["ncp_cloze"]["settings"]["limit"] == 6 and res["n-samples"]["ncp_cloze"]["effective"] == 6
    assert res["scored"]["ncp_cloze"]["settings"]["seed"] == [5, 5, 5, 5]
    assert "ncp_last_ident" in Path(second["files"]["markdown"]).read_text()


def test_seeds_generation_settings_and_fractional_limits_are_recorded_and_flagged(runs, tmp_path: Path) -> None:
    a, b = (_run_copy(runs, "concept", tmp_path / k) for k in ("a", "b"))
    evaluate(_target(a, ["ncp_last_ident"], 3))
    s = evaluate(_target(b, ["ncp_last_ident"], 0.05, seed=settings.parse_seed("7"),
                         gen_kwargs=settings.parse_gen_kwargs('{"max_gen_toks": 3, "until": ["\\n", ","]}')))
    res = json.loads(Path(s["files"]["json"]).read_text())
    got = res["scored"]["ncp_last_ident"]["settings"]
    n = res["n-samples"]["ncp_last_ident"]
    assert got["limit"] == 0.05 and got["examples"] == n["effective"] == math.ceil(0.05 * n["original"])
    assert got["seed"] == [7, 7, 7, 7] and res["config"]["random_seed"] == 7 and res["config"]["fewshot_seed"] == 7
    assert got["generation_kwargs"]["max_gen_toks"] == 3 and got["generation_kwargs"]["until"] == ["\n", ","]
    notes = compare([str(a), str(b)], out=str(tmp_path / "cmp"))["notes"]
    for what in ("limits", "seeds", "generation settings"):
        assert any(n.startswith(f"evaluated with different {what}: ncp_last_ident") for n in notes), (what, notes)
    # the flags: bad input is one error line, exit 2 (before any model loads)
    with pytest.raises(UserError, match="four comma-separated"):
        settings.parse_seed("1,2")
    with pytest.raises(UserError, match="unknown key 'temp'"):
        settings.parse_gen_kwargs("temp=0.5")
    with pytest.raises(UserError, match="whole number"):
        settings.parse_limit(2.5)
    r = run_cli("eval", str(a), "--gen-kwargs", "temprature=0.5")
    assert r.returncode == 2 and r.stderr.startswith("error: --gen-kwargs: unknown key 'temprature'"), r.stderr


def test_an_interrupted_evaluation_resumes_and_a_changed_checkpoint_is_scored_anew(runs, tmp_path, monkeypatch):
    import sqlite3

    from ncpctl.evaluate.lm import NCPLM

    run = _run_copy(runs, "concept", tmp_path / "run")
    # batch 1: the cache commits every 4 requests (cache.CHUNK batches)
    whole = evaluate(_target(run, ["ncp_cloze"], 4, batch=1, cache=False))  # 4 questions x 4 options
    assert whole["model_requests"] == 16
    real, calls = NCPLM._loglikelihood_answers, []

    def dies_on_the_second_chunk(self, requests):
        calls.append(len(requests))
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) in the middle of the evaluation
        return real(self, requests)

    monkeypatch.setattr(NCPLM, "_loglikelihood_answers", dies_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        evaluate(_target(run, ["ncp_cloze"], 4, batch=1))
    db = run / "eval" / "cache" / "step_0000200.sqlite"
    kept = calls[0]  # the first chunk was committed before the interruption
    monkeypatch.setattr(NCPLM, "_loglikelihood_answers", real)
    resumed = evaluate(_target(run, ["ncp_cloze"], 4, batch=1))
    assert 0 < kept < 16 and resumed["model_requests"] == 16 - kept
    assert resumed["results"] == whole["results"]
    more = evaluate(_target(run, ["ncp_cloze", "ncp_last_ident"], 4, batch=1))  # one more task: its 4 generations
    assert more["model_requests"] == 4 and more["results"]["ncp_cloze"] == whole["results"]["ncp_cloze"]
    # the same checkpoint name with other weights: its old answers are never served
    from safetensors.torch import load_file, save_file

    ck = run / "checkpoints" / "step_0000200"
    w = load_file(str(ck / "model.safetensors"))
    save_file({k: v * 1.5 for k, v in w.items()}, str(ck / "model.safetensors"))
    changed = evaluate(_target(run, ["ncp_cloze"], 4, batch=1))
    assert changed["model_requests"] == 16
    with sqlite3.connect(db) as con:  # emptied before use: the 4 generations of the old weights are gone
        assert con.execute("SELECT COUNT(*) FROM answers").fetchone()[0] == 16
