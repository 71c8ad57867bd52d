"""Capability proxies (ncpctl.evaluate.proxy): the two-level average, the margin, the correlation view,
bad input, and `ncpctl eval --proxy` on the shipped set through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate import proxy

from ..conftest import run_cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox"
SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "proxy" / "python_packages.jsonl"


def _word_scorer(pairs):
    """Tokens = words; log p = -(characters of the words): an item's NLL per token is its mean word length."""
    return [(-float(sum(len(w) for w in c.split())), len(c.split())) for _, c in pairs]


def _items(dup: int = 1) -> list[proxy.Item]:
    s1 = [proxy.Item("p", "aa bb", "s1", "A"), proxy.Item("p", "aaaa", "s1", "A")] * dup  # NLL 2, 4
    return [*s1, proxy.Item("p", "a", "s2", "A"), proxy.Item("p", "abc", "s3", "B")]  # NLL 1; 3


def test_two_level_average_equals_hand_computation_and_ignores_duplicates() -> None:
    r = proxy.score(_items(), _word_scorer)["nll"]
    # A: source s1 = (2 + 4) / 2 = 3, s2 = 1 -> (3 + 1) / 2 = 2 (the item mean would be 7/3); B = 3
    assert r["capabilities"] == pytest.approx({"A": 2.0, "B": 3.0})
    assert r["overall"] == pytest.approx(2.5)
    assert r["sources"]["A/s1"] == {"value": pytest.approx(3.0), "items": 2}
    r5 = proxy.score(_items(dup=5), _word_scorer)["nll"]  # s1's items five times over: same averages
    assert r5["capabilities"] == pytest.approx(r["capabilities"]) and r5["sources"]["A/s1"]["items"] == 10


def test_margin_on_a_hand_made_item() -> None:
    table = {"good ending": -3.0, "bad": -2.0, "worse one": -9.0}
    item = proxy.Item("ctx", "good ending", "src", "mc", ("bad", "good ending", "worse one"), 1)
    rep = proxy.score([item], lambda pairs: [(table[c], 1) for _, c in pairs])
    # char-normalised: good -3/11, bad -2/3, worse -1 -> margin = -3/11 + 2/3 (bad is the strongest distractor)
    assert rep["margin"]["overall"] == pytest.approx(-3 / 11 + 2 / 3)
    assert proxy.margin([-3.0, -2.0], ["good ending", "bad"], 1) == pytest.approx(-2 / 3 + 3 / 11)


def test_correlation_view() -> None:
    c = proxy.correlate([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])  # y = 2x + 1
    assert (c["slope"], c["intercept"], c["r2"], c["spearman"]) == pytest.approx((2.0, 1.0, 1.0, 1.0))
    c = proxy.correlate([1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 0.5, 0.0])  # monotone down, not linear
    assert c["spearman"] == pytest.approx(-1.0) and c["slope"] < 0 and 0 < c["r2"] < 1


def test_a_missing_field_is_one_line_each(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "x", "suffix": "y", "source": "s"}) + "\n"
                 + json.dumps({"prompt": "x", "suffix": "y", "source": "s", "capability": "c"}) + "\n")
    with pytest.raises(UserError) as e:
        proxy.read_spec(f)
    assert e.value.problems == [f"{f}:1: missing field capability"]
    r = run_cli("eval", "--proxy", str(f), str(FIXTURE))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error")] == [f"error: {f}:1: missing field capability"]


def test_shipped_set_through_the_cli(tmp_path: Path) -> None:
    items = proxy.read_spec(SHIPPED)
    assert {it.source for it in items} == {"networkx", "mpmath"} and any(it.choices for it in items)
    spec = tmp_path / "small.jsonl"  # a slice keeps the test to seconds: 3 items per (source, capability)
    keep, seen = [], {}
    for line in SHIPPED.read_text().splitlines():
        d = json.loads(line)
        k = (d["source"], d["capability"])
        if seen.get(k, 0) < 3:
            seen[k] = seen.get(k, 0) + 1
            keep.append(line)
    spec.write_text("\n".join(keep) + "\n")
    r = run_cli("eval", "--proxy", str(spec), str(FIXTURE), "--out", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])["per_checkpoint"][str(FIXTURE.resolve())]
    caps = rep["nll"]["capabilities"]
    assert set(caps) == {"function generation", "function choice"} and all(0 < v < 20 for v in caps.values())
    assert rep["mc_items"] == 6 and isinstance(rep["margin"]["overall"], float)
    assert (tmp_path / "out" / f"proxy_{FIXTURE.name}.json").is_file()


def test_builder_makes_a_valid_set_from_held_out_packages(tmp_path: Path) -> None:
    from ncpctl.evaluate.proxy_build import main

    f = tmp_path / "p.jsonl"
    main(["--packages", "mpmath", "--per-source", "2", "--out", str(f)])
    items = proxy.read_spec(f)  # every line has the four fields; choices hold the suffix at label
    assert {(it.source, it.capability) for it in items} == {("mpmath", "function generation"),
                                                            ("mpmath", "function choice")}
    for it in items:
        assert it.prompt.lstrip().startswith(("def ", "@", "async def ")) and ('"""' in it.prompt or "'''" in it.prompt)
        assert not it.choices or (len(it.choices) == 4 and it.choices[it.label] == it.suffix)


def test_against_reads_each_checkpoints_own_results_when_out_is_elsewhere(tmp_path: Path) -> None:
    """`--against` with `--out`: the downstream score is where `ncpctl eval` wrote it, the run's eval/."""
    import shutil

    spec = tmp_path / "one.jsonl"
    spec.write_text(SHIPPED.read_text().splitlines()[0] + "\n")
    cks = []
    for i, acc in enumerate((0.25, 0.5)):
        ck = tmp_path / f"run{i}" / "checkpoints" / "step_0000020"
        shutil.copytree(FIXTURE, ck)
        (ck.parent / "latest").write_text(ck.name + "\n")
        (tmp_path / f"run{i}" / "eval").mkdir()
        (tmp_path / f"run{i}" / "eval" / "results_step_0000020.json").write_text(
            json.dumps({"results": {"ncp_cloze": {"acc,none": acc}}}))
        cks.append(str(ck))
    got = proxy.evaluate_proxy(cks, str(spec), against="ncp_cloze:acc", out=str(tmp_path / "out"))
    assert [r["downstream"]["value"] for r in got["per_checkpoint"].values()] == [0.25, 0.5]
    assert got["correlation"]["n_checkpoints"] == 2
