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
