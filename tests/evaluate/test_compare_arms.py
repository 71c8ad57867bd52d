"""Seed arms in `ncpctl eval --compare A1,A2,A3 B1,B2,B3` (ncpctl.evaluate.compare_arms, issue 26
item 4): mean ± std per arm, the paired bootstrap on per-example scores (its interval covers a known
difference at about its nominal rate and excludes 0 when the difference is large), and one error line
naming the keys when an arm's runs differ in more than the seed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ncpctl.evaluate import compare_arms
from ncpctl.evaluate.compare import compare

from ..conftest import run_cli

TAG = "step_0000010"


def _run(root: Path, name: str, seed: int, acc: np.ndarray, lr: float = 3e-3) -> Path:
    """A run directory with eval results (per-example acc) and the checkpoint's recorded recipe."""
    run = root / name
    ck = run / "checkpoints" / TAG
    ck.mkdir(parents=True)
    recipe = {"run": {"dir": str(run), "name": name}, "train": {"seed": seed, "lr": lr}, "model": {"size": "debug"}}
    (ck / "ncpctl.json").write_text(json.dumps({"format": "ncpctl-checkpoint", "version": 1, "step": 10,
                                                "tokens_seen": 1000, "recipe": recipe}))
    (run / "eval").mkdir()
    res = {"results": {"toy": {"alias": "toy", "acc,none": float(acc.mean()), "acc_stderr,none": 0.01}},
           "per_example": {"toy": {"doc_id": list(range(len(acc))), "acc": acc.tolist()}},
           "request": {"tasks": ["toy"], "limit": None, "heldout": []}}
    (run / "eval" / f"results_{TAG}.json").write_text(json.dumps(res))
    return run


def _arm_scores(rng, base: np.ndarray, shift: float, seeds: int) -> list[np.ndarray]:
    """Per-example 0/1 scores of ``seeds`` runs whose success probability is base + shift."""
    return [(rng.random(len(base)) < np.clip(base + shift, 0, 1)).astype(float) for _ in range(seeds)]


def test_arms_mean_std_and_a_large_difference_excludes_zero(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.8, 300)  # per-example difficulty shared by both arms
    a = [_run(tmp_path, f"a{s}", s, x) for s, x in enumerate(_arm_scores(rng, base, 0.0, 3))]
    b = [_run(tmp_path, f"b{s}", s, x) for s, x in enumerate(_arm_scores(rng, base, 0.15, 3))]
    r = run_cli("eval", "--compare", ",".join(map(str, a)), ",".join(map(str, b)), "--json", "--out",
                str(tmp_path / "out"), "--resamples", "500", "--level", "0.9")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    arms = got["arms"]
    assert [x["runs"] for x in arms["arms"]] == [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    row = next(x for x in arms["rows"] if (x["task"], x["metric"]) == ("toy", "acc"))
    means = [[json.loads((run / "eval" / f"results_{TAG}.json").read_text())["results"]["toy"]["acc,none"]
              for run in arm] for arm in (a, b)]
    for st, vals in zip(row["arms"], means):  # mean ± sample std over the seeds, by hand
        assert st["mean"] == pytest.approx(np.mean(vals)) and st["std"] == pytest.approx(np.std(vals, ddof=1))
    d = row["diff"][0]
    assert d["mean_diff"] == pytest.approx(np.mean(means[1]) - np.mean(means[0]))
    bs = d["bootstrap"]
    assert bs["n"] == 300 and bs["level"] == 0.9 and bs["diff"] == pytest.approx(d["mean_diff"])
    assert 0 < bs["low"] < bs["diff"] < bs["high"] and bs["p"] < 0.01
    md = Path(got["files"]["markdown"]).read_text()
    assert "Seed arms" in md and "paired bootstrap over 300 examples" in md and "[90%:" in md


def test_the_arm_interval_covers_a_known_difference_at_its_nominal_rate() -> None:
    rng = np.random.default_rng(3)
    true, draws, hits = 0.03, 120, 0
    for _ in range(draws):
        base = rng.uniform(0.3, 0.7, 400)
        runs = [SimpleNamespace(label=f"{arm}{s}", res={"per_example": {"t": {"doc_id": list(range(400)), "acc": x}}})
                for arm, shift in (("a", 0.0), ("b", true)) for s, x in enumerate(
                    # a run's per-example score: its example's probability plus seed noise (mean 0)
                    [(base + shift + rng.normal(0, 0.05, 400)).tolist() for _ in range(2)])]
        rows = [{"section": "tasks", "task": "t", "metric": "acc", "values": {e.label: 0.5 for e in runs}}]
        rep = compare_arms.report(runs, [0, 0, 1, 1], rows, level=0.95, resamples=300)
        bs = rep["rows"][0]["diff"][0]["bootstrap"]
        hits += bs["low"] <= true <= bs["high"]
    assert 0.88 <= hits / draws <= 0.995  # nominal 95% (binomial sd over 120 draws ~2 points)


def test_an_arm_whose_runs_differ_in_more_than_the_seed_is_one_line(tmp_path: Path) -> None:
    x = np.ones(10)
    a0, a1 = _run(tmp_path, "a0", 0, x), _run(tmp_path, "a1", 1, x, lr=1e-3)
    b0, b1 = _run(tmp_path, "b0", 0, x), _run(tmp_path, "b1", 1, x)
    r = run_cli("eval", "--compare", f"{a0},{a1}", f"{b0},{b1}", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "a1 differs from a0 in more than the seed: train.lr" in errors[0]


def test_the_printed_notes_keep_their_square_brackets() -> None:
    """The caption is plain text: a perplexity rule's `[token perplexity]` and an interval's `[95%: ...]`
    were read as rich markup (the unit vanished from the printed rule)."""
    from rich.console import Console

    from ncpctl.evaluate.compare import rich_table

    payload = {"runs": [{"label": "a"}, {"label": "b"}], "baseline": "a", "rows": [],
               "notes": ["perplexity averages: mean_of_sets = (ncp_heldout_ppl [token perplexity]) / 1"]}
    con = Console(width=200, record=True)
    con.print(rich_table(payload))
    assert "(ncp_heldout_ppl [token perplexity]) / 1" in " ".join(con.export_text().split())


def test_an_arm_of_one_run_has_no_std_and_the_json_stays_json(tmp_path: Path) -> None:
    """``--compare BASE B1,B2``: the one-run arm's std is undefined; --json and compare_*.json must
    still be JSON (null, not the NaN token that jq and JSON.parse reject)."""
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))

    rng = np.random.default_rng(1)
    base = rng.uniform(0.2, 0.8, 50)
    a = _run(tmp_path, "a0", 0, _arm_scores(rng, base, 0.0, 1)[0])
    b = [_run(tmp_path, f"b{s}", s, x) for s, x in enumerate(_arm_scores(rng, base, 0.1, 2))]
    r = run_cli("eval", "--compare", str(a), ",".join(map(str, b)), "--json", "--out", str(tmp_path / "out"),
                "--resamples", "100")
    assert r.returncode == 0, r.stderr[-2000:]
    got = strict(r.stdout.strip().splitlines()[-1])
    row = next(x for x in got["arms"]["rows"] if (x["task"], x["metric"]) == ("toy", "acc"))
    assert row["arms"][0]["n"] == 1 and row["arms"][0]["std"] is None and row["arms"][1]["std"] is not None
    strict(Path(got["files"]["json"]).read_text())


def _agg_run(root: Path, name: str, seed: int, scores: dict[str, np.ndarray]) -> Path:
    """A run whose results carry two tasks' per-example acc and a paper aggregate over them (built by
    ``protocol.aggregate``, as ``ncpctl eval`` builds it)."""
    from ncpctl.evaluate import protocol

    run = _run(root, name, seed, scores["t1"])
    p = protocol.Protocol("grp", [protocol.Member(t, None, "acc,none") for t in scores], "Avg", "unweighted_mean")
    results = {t: {"alias": t, "acc,none": float(x.mean())} for t, x in scores.items()}
    res = {"results": results, "request": {"tasks": ["grp"], "limit": None, "heldout": []},
           "per_example": {t: {"doc_id": list(range(len(x))), "acc": x.tolist()} for t, x in scores.items()},
           "n-samples": {t: {"original": len(x), "effective": len(x)} for t, x in scores.items()},
           "aggregates": {"grp": protocol.aggregate(p, results)}}
    (run / "eval" / f"results_{TAG}.json").write_text(json.dumps(res))
    return run


def test_a_paper_aggregate_gets_a_row_and_a_stratified_bootstrap(tmp_path: Path) -> None:
    """ConceptLM's +0.1/+0.4 are differences of an "Avg": the aggregate is a row of --compare, and its
    seed-arm interval resamples each task's examples within the task and takes the mean of task means
    (not the pooled mean over all examples: the tasks differ in size); the p-value says it is approximate."""
    rng = np.random.default_rng(5)
    sizes, shift = {"t1": 300, "t2": 30}, {"t1": 0.0, "t2": 0.3}
    base = {t: rng.uniform(0.2, 0.6, n) for t, n in sizes.items()}
    arms = [[_agg_run(tmp_path, f"{arm}{s}", s, {t: (rng.random(n) < base[t] + (shift[t] if arm == "b" else 0))
                                                 .astype(float) for t, n in sizes.items()})
             for s in range(2)] for arm in ("a", "b")]
    got = compare([",".join(map(str, arm)) for arm in arms], out=str(tmp_path / "out"), resamples=400)
    row = next(r for r in got["rows"] if r["section"] == "aggregates")
    assert (row["task"], row["metric"]) == ("grp", "Avg")
    per = {run.name: json.loads((run / "eval" / f"results_{TAG}.json").read_text()) for arm in arms for run in arm}
    assert row["values"] == pytest.approx({k: v["aggregates"]["grp"]["value"] for k, v in per.items()})
    arm_row = next(r for r in got["arms"]["rows"] if r["section"] == "aggregates")
    bs = arm_row["diff"][0]["bootstrap"]
    means = {t: [np.mean([per[r.name]["per_example"][t]["acc"] for r in arm], axis=0) for arm in arms] for t in sizes}
    by_task = np.mean([(b - a).mean() for a, b in means.values()])  # the mean of the task means' differences
    pooled = np.concatenate([b - a for a, b in means.values()]).mean()
    assert bs["strata"] == 2 and bs["n"] == 330 and bs["diff"] == pytest.approx(by_task)
    assert abs(by_task - pooled) > 0.05 and bs["low"] < bs["diff"] < bs["high"]
    text = "\n".join(compare_arms.lines(got["arms"]))
    assert "grp Avg:" in text and "in 2 tasks, stratified" in text and "p ≈ " in text and "(approximate)" in text


def test_the_stratified_interval_covers_a_known_aggregate_difference() -> None:
    from ncpctl.evaluate.uncertainty import stratified_bootstrap

    rng = np.random.default_rng(11)
    true, hits, draws = 0.5 * 0.02 + 0.5 * 0.08, 0, 100
    for _ in range(draws):
        strata = []
        for n, d in ((400, 0.02), (60, 0.08)):
            a = rng.normal(0.5, 0.1, n)
            strata.append((a, a + d + rng.normal(0, 0.1, n), 0.5))
        bs = stratified_bootstrap(strata, iters=300, level=0.9, seed=0)
        hits += bs["low"] <= true <= bs["high"]
    assert 0.8 <= hits / draws <= 0.98  # nominal 90%
