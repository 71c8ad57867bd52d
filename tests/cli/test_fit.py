"""`ncpctl fit` end to end: a table through the real entry point, every bad input refused with one
line and exit 2 (in-process, typer's CliRunner), run directories read from their own files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncpctl.cli.app import app
from ncpctl.study.synthetic import CHINCHILLA, faster, isoflop_points

from ..conftest import RECIPES, run_cli

BUDGETS = (1e18, 1e19, 1e20)


def _table(path: Path, **extra_cols) -> Path:
    rng = np.random.default_rng(0)
    pts = isoflop_points(CHINCHILLA, "base", rng, BUDGETS) + isoflop_points(faster(CHINCHILLA, 1.5), "new", rng, BUDGETS)
    path.write_text(json.dumps([{**p.to_dict(), **extra_cols} for p in pts]))
    return path


def test_fit_a_table_through_the_entry_point(tmp_path: Path) -> None:
    r = run_cli("fit", str(_table(tmp_path / "points.json")), "--resamples", "20", "--out", str(tmp_path / "out"),
                "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["command"] == "fit" and rep["points"] == 30
    assert set(rep["families"]) == {"base", "new"}
    m = rep["multiplier"]
    assert m["family"] == "new" and m["baseline"] == "base" and abs(m["value"] / 1.5 - 1) < 0.1
    assert m["ci90"][0] < m["value"] < m["ci90"][1]
    assert [r["budget"] for r in m["by_budget"]] == list(BUDGETS)
    assert all(abs(r["value"] / 1.5 - 1) < 0.1 for r in m["by_budget"])  # the truth is 1.5 at every budget
    for fam in rep["families"].values():
        assert len(fam["isoflop"]["budgets"]) == 3 and "N_opt_exponent" in fam["isoflop"]
        assert fam["extrapolation"]["held_out"] and "log_linear" in fam["extrapolation"]
    saved = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert saved["multiplier"]["value"] == m["value"] and len(saved["input"]) == 30
    md = (tmp_path / "out" / "fit.md").read_text()
    assert "Compute multiplier" in md and "| new |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in md
    else:
        assert (tmp_path / "out" / "fit_frontier.png").stat().st_size > 0
        assert (tmp_path / "out" / "fit_isoflop.png").stat().st_size > 0
        assert (tmp_path / "out" / "fit_residuals.png").stat().st_size > 0


def _bad(tmp_path: Path, name: str) -> list[str]:
    """A table (or its argument list) that `fit` must refuse."""
    good = _table(tmp_path / "points.json")
    rows = json.loads(good.read_text())
    p = tmp_path / "bad.json"
    if name == "too_few_points":
        p.write_text(json.dumps([r for r in rows if r["family"] == "base"][:4]))
    elif name == "unknown_metric":
        return [str(good), "--metric", "concept_auc"]
    elif name == "mixed_tokenizers":
        p.write_text(json.dumps([{**r, "tokenizer": "sha-a" if r["family"] == "base" else "sha-b"} for r in rows]))
    elif name == "mixed_validation_sets":
        p.write_text(json.dumps([{**r, "val_set": str(i % 2)} for i, r in enumerate(rows)]))
    elif name == "not_json":
        p.write_text("[{")
    elif name == "missing_column":
        p.write_text(json.dumps([{k: v for k, v in r.items() if k != "C"} for r in rows]))
    elif name == "not_a_number":
        p.write_text(json.dumps([{**r, "loss": "low"} for r in rows]))
    elif name == "csv_without_header":
        p = tmp_path / "bad.csv"
        p.write_text("1,2,3\n4,5,6\n")
    elif name == "missing_file":
        return [str(tmp_path / "nope.json")]
    elif name == "unknown_family":
        return [str(good), "--baseline", "old"]
    elif name == "unreachable_loss":
        return [str(good), "--at-loss", "1.0"]  # below both families' fitted E (1.69)
    return [str(p)]


@pytest.mark.parametrize("name, message", [
    ("too_few_points", "at least 10 points (twice its parameters), got 4"),
    ("unknown_metric", "unknown metric 'concept_auc'"),
    ("mixed_tokenizers", "mix 2 tokenizers"),
    ("mixed_validation_sets", "mix 2 validation sets"),
    ("not_json", "not JSON"),
    ("missing_column", "missing column(s) C"),
    ("not_a_number", "column 'loss' is not a number"),
    ("csv_without_header", "needs a header with the columns N, D and C"),
    ("missing_file", "no such file or run directory"),
    ("unknown_family", "no family named 'old'"),
    ("unreachable_loss", "fitted law never reaches loss 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, name: str, message: str) -> None:
    r = CliRunner().invoke(app, ["fit", *_bad(tmp_path, name), "--resamples", "0", "--no-plots",
                                 "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 2, (r.output, r.exception)
    out = json.loads(r.stdout)
    assert out["ok"] is False and len(out["errors"]) == 1 and message in out["errors"][0], out
    assert not (tmp_path / "out").exists()  # nothing written for refused input


def _run_dir(root: Path, name: str, steps: int, loss: float, tokenizer_sha: str, recipe_name: str = "debug.yaml",
             **train_extra: float) -> Path:
    from ncpctl.recipe.load import load_recipe

    run = root / name
    recipe = load_recipe(RECIPES / recipe_name)
    recipe.write_resolved(run)
    (run / "data").mkdir()
    (run / "data" / "meta.json").write_text(json.dumps({"tokenizer": {"sha256": tokenizer_sha},
                                                        "source_fingerprint": "src",
                                                        "split": {"val_fraction": 0.01, "split_seed": 1}}))
    tokens = steps * recipe.global_batch_size * recipe.seq_len
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"split": "train", "step": steps, "tokens": tokens, "loss": loss + 0.1, **train_extra},
        {"split": "val", "step": steps, "loss": loss, "ncp_loss": 1.0})) + "\n")
    return run


def test_run_directories_give_exact_counts_and_refuse_mixed_tokenizers(tmp_path: Path) -> None:
    """N is the model's parameter count, D the tokens of the last training record, C the exact
    training FLOPs of those steps; runs of two tokenizers are refused."""
    from ncpctl.model.accounting.flops import count_parameters, exact_flops
    from ncpctl.recipe.load import load_recipe
    from ncpctl.study.points import read_points

    a = _run_dir(tmp_path / "base", "s1", 10, 3.0, "sha-a")
    b = _run_dir(tmp_path / "base", "s2", 20, 2.9, "sha-a")
    p = read_points([str(a), str(b)], family_from_parent=True)
    r = load_recipe(a / "recipe.resolved.yaml")
    per_step = exact_flops(r.model_config, r.seq_len, r.global_batch_size).training_per_step()
    assert [q.family for q in p] == ["base", "base"]
    assert p[0].N == count_parameters(r.model_config).total
    assert p[1].D == 20 * r.global_batch_size * r.seq_len and p[1].C == 20 * per_step
    assert p[0].metrics == {"loss": 3.0, "ncp_loss": 1.0}
    assert [q.name for q in read_points([str(tmp_path)], family_from_parent=True)] == [str(a), str(b)]  # found below
    c = _run_dir(tmp_path / "other", "s1", 10, 3.0, "sha-b")
    res = CliRunner().invoke(app, ["fit", str(tmp_path), "--json"])
    assert res.exit_code == 2 and "mix 2 tokenizers" in json.loads(res.stdout)["errors"][0], res.output
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["fit", str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 2 and "none below it" in json.loads(res.stdout)["errors"][0], res.output


def test_a_sweeps_points_are_of_the_sweeps_family(tmp_path: Path) -> None:
    """Every sweep writes its points to OUT/runs/NAME: the family is OUT's name (two sweeps, two
    families), not the ``runs`` they all share; a plain runs/NAME without a manifest stays ``runs``."""
    from ncpctl.study.points import read_points
    from ncpctl.study.sweep import MANIFEST

    for fam in ("base", "conceptlm"):
        (tmp_path / "study" / fam).mkdir(parents=True)
        (tmp_path / "study" / fam / MANIFEST).write_text("{}")
        _run_dir(tmp_path / "study" / fam / "runs", "d32", 10, 3.0, "sha-a")
    assert [p.family for p in read_points([str(tmp_path / "study")], family_from_parent=True)] == ["base", "conceptlm"]
    plain = _run_dir(tmp_path / "runs", "s1", 10, 3.0, "sha-a")
    assert read_points([str(plain)], family_from_parent=True)[0].family == "runs"


def test_a_dlcm_run_is_costed_at_its_realised_tokens_per_concept(tmp_path: Path) -> None:
    """A dynamic segmentation's FLOPs are those of the concepts it made (the training records'
    tokens_per_concept), not of the target R."""
    from ncpctl.model.accounting.flops import exact_flops
    from ncpctl.recipe.load import load_recipe
    from ncpctl.study.points import read_run

    run = _run_dir(tmp_path, "dlcm", 10, 3.0, "sha-a", "debug-dlcm.yaml", tokens_per_concept=3.0)
    r = load_recipe(run / "recipe.resolved.yaml")
    at = lambda ratio: exact_flops(r.model_config, r.seq_len, r.global_batch_size,  # noqa: E731
                                   realised_ratio=ratio).training_per_step()
    assert r.model_config.concept.target_ratio != 3.0 and at(3.0) != at(None)
    assert read_run(run).C == 10 * at(3.0)


def test_a_run_directory_gives_nonembedding_costs_epochs_and_its_concept_share(tmp_path: Path) -> None:
    """Issue 40 items 5b, 7b, 7c: a run directory's point carries N and C without the embeddings and the
    LM head, its epochs over the training split, and a concept path's R and P (DLCM's, for --dlcm: the
    realised tokens per concept, the concept transformer's share of the non-embedding parameters)."""
    from ncpctl.model.accounting.flops import count_parameters, exact_flops
    from ncpctl.recipe.load import load_recipe
    from ncpctl.study.points import read_run

    run = _run_dir(tmp_path, "s1", 10, 3.0, "sha-a")
    meta = json.loads((run / "data" / "meta.json").read_text())
    (run / "data" / "meta.json").write_text(json.dumps({**meta, "splits": {"train": {"tokens": 1000}}}))
    r = load_recipe(run / "recipe.resolved.yaml")
    cfg, G, T = r.model_config, r.global_batch_size, r.seq_len
    params = count_parameters(cfg).components
    head = 3 * G * 2 * T * cfg.d_model * cfg.padded_vocab_size  # the LM head's matmul, forward and backward
    p = read_run(run)
    n_ne = p.N - params["embeddings"] - params["lm_head"]
    assert p.settings["N_nonembedding"] == n_ne and p.metrics == {"loss": 3.0, "ncp_loss": 1.0}
    assert p.settings["C_nonembedding"] == 10 * (exact_flops(cfg, T, G).training_per_step() - head)
    assert p.settings["epochs"] == 10 * G * T / 1000
    assert (p.settings["R"], p.settings["P"]) == (cfg.concept.k, params["concept_layers"] / n_ne)
    dlcm = read_run(_run_dir(tmp_path, "dlcm", 10, 3.0, "sha-a", "debug-dlcm.yaml", tokens_per_concept=3.0))
    assert dlcm.settings["R"] == 3.0 and 0 < dlcm.settings["P"] < 1


def _skips(path: Path, n_points: int = 12) -> Path:
    """One family of 12 points: a budget of 3 sizes (a parabola without residual degrees of freedom), one
    of 4 whose parabola opens downward, one of 5 whose vertex lies beyond its sizes."""
    rows = []
    for C, sizes, curve in ((1e18, (1e7, 3e7, 1e8), 1.0), (1e19, (3e7, 6e7, 1e8, 2e8), -1.0),
                            (1e20, (2.5e8, 3e8, 4e8, 5e8, 6e8), 1.0)):
        n_opt = 2e7 * (C / 1e18) ** 0.5
        rows += [{"family": "x", "N": n, "D": C / (6 * n), "C": C, "budget": C, "epochs": C / 1e19,
                  "loss": 2 + 40 * (C ** -0.05) + curve * 0.05 * np.log(n / n_opt) ** 2} for n in sizes]
    path.write_text(json.dumps(rows[:n_points]))
    return path


def test_fit_says_what_it_skipped_and_how_sure_it_is(tmp_path: Path) -> None:
    """Issue 46 item 3: on the terminal, the budget skipped and why, what * means, no RMSE for a parabola
    through 3 points, a caution for a joint law of fewer than 15 points; fewer than 10 are refused.
    Issue 40 item 7c: points that repeat their training data (epochs above 1) get a warning."""
    r = CliRunner().invoke(app, ["fit", str(_skips(tmp_path / "p.json")), "--resamples", "0", "--no-plots",
                                 "--out", str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "x: budget 1e+19 (4 points) skipped: no minimum (the parabola opens downward)" in out
    assert "(* vertex outside the sampled sizes)" in out and "x: * the vertex at budget(s) 1e+20 lies outside" in out
    assert "rmse '-': a parabola through 3 points has no residual degrees of freedom" in out
    row = next(line for line in out.splitlines() if "│ x" in line and "1e+18" in line)
    assert row.rstrip(" │").endswith("-")  # its rmse column
    assert "x: caution: 12 points for the law's 5 parameters (fewer than 15)" in out
    assert "warning: 5 point(s) repeat their training data (epochs over the training split up to 10.00" in r.stderr
    rep = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert rep["families"]["x"]["isoflop"]["budgets"][0]["rmse"] is None
    r = CliRunner().invoke(app, ["fit", str(_skips(tmp_path / "p8.json", 8)), "--resamples", "0", "--no-plots",
                                 "--out", str(tmp_path / "out8"), "--json"])
    assert r.exit_code == 2 and "a fit needs at least 10 points (twice its parameters), got 8" in \
        json.loads(r.stdout)["errors"][0]


def test_points_are_found_at_any_depth_and_the_fit_says_where(tmp_path: Path) -> None:
    """Issue 46 item 3: runs five levels below the given directory are found, and the fit says where."""
    from ncpctl.study.points import read_points, where_found

    deep = _run_dir(tmp_path / "study" / "a" / "b" / "c" / "runs", "s1", 10, 3.0, "sha-a")
    near = _run_dir(tmp_path / "study", "s2", 10, 3.0, "sha-a")
    found: dict = {}
    assert [p.name for p in read_points([str(tmp_path / "study")], found=found)] == [str(deep), str(near)]
    assert where_found(str(tmp_path / "study"), found[str(tmp_path / "study")]) == \
        f"{tmp_path / 'study'}: 2 run directories, in ./ (1), a/b/c/runs/ (1)"
    r = CliRunner().invoke(app, ["fit", str(tmp_path / "study"), "--no-plots", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "2 run directories, in ./ (1), a/b/c/runs/ (1)" in r.stderr  # then too few points


def test_the_isoflop_plot_labels_do_not_overlap(tmp_path: Path) -> None:
    """Issue 46 item 3: sizes 50k-600k (a log axis labels its minor ticks there, 4x10^5 over 5x10^5): the
    sampled sizes are the ticks, written compactly, none overlapping another."""
    pytest.importorskip("matplotlib")
    from ncpctl.study.fit import FitOptions, analyse
    from ncpctl.study.points import Point
    from ncpctl.study.report import isoflop_figure

    pts = [Point("x", N=float(n), D=C / (6 * n), C=C, budget=C, metrics={"loss": 3 + 0.1 * np.log(n / 2e5) ** 2 - k / 10})
           for k, C in enumerate((1e14, 1e15)) for n in np.geomspace(5e4, 6e5, 6)]
    fig = isoflop_figure(analyse(pts, FitOptions(resamples=0)))
    fig.canvas.draw()
    boxes = sorted((t.get_window_extent().x0, t.get_window_extent().x1) for ax in fig.axes
                   for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True) if t.get_text() and t.get_visible())
    assert len(boxes) >= 4 and all(a[1] <= b[0] for a, b in zip(boxes, boxes[1:])), boxes
