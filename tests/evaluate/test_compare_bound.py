"""Issue 23 item 4: ``ncpctl eval --compare`` does not rank an autoregressive model's exact
cross-entropy against a Causal Diffusion LM's ELBO bound without saying so: the first note says
which run reports which and that the deltas are not a ranking; runs of one kind get no such note;
validation curves of a bound and of a cross-entropy are labelled the same way."""

from __future__ import annotations

import json
from pathlib import Path

from ncpctl.evaluate.compare import compare


def _run(root: Path, name: str, nll: float, likelihood: dict | None, val_key: str) -> Path:
    run = root / name
    (run / "eval").mkdir(parents=True)
    ppl = {"per_set": {"held": {"metric": "token_perplexity", "unit": "token perplexity", "value": 2.0 ** nll,
                                "split": None, "averaged": True, "token_perplexity": 2.0 ** nll, "tokens": 10,
                                "nll": 10 * nll}},
           "mean_of_sets": 2.0 ** nll, "token_weighted": 2.0 ** nll, "averaged": ["held"], "excluded": [],
           "rule": "mean_of_sets = (held [token perplexity]) / 1"}
    res = {"results": {"held": {"token_perplexity,none": 2.0 ** nll}}, "perplexity": ppl,
           "request": {"tasks": [], "heldout": [], "limit": None, "num_fewshot": None}}
    if likelihood is not None:  # results written before the field existed: exact
        res["likelihood"] = likelihood
    (run / "eval" / "results_step_0000010.json").write_text(json.dumps(res))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"split": "val", "step": s, val_key: 6.0 - s / 10}) + "\n"
                                               for s in (5, 10)))
    return run


def test_compare_says_a_bound_is_not_ranked_against_an_exact_cross_entropy(tmp_path):
    ar = _run(tmp_path, "ar", 3.0, None, "ntp_loss")
    cdlm = _run(tmp_path, "cdlm", 2.5, {"kind": "bound", "samples": 8}, "diffusion_elbo")
    other_ar = _run(tmp_path, "ar2", 3.5, {"kind": "exact"}, "ntp_loss")
    got = compare([str(ar), str(cdlm)], out=str(tmp_path / "out"))
    first = got["notes"][0]
    assert first.startswith("NOT A RANKING") and "ar: exact cross-entropy" in first
    assert "cdlm: an ELBO bound (8 Monte Carlo samples)" in first
    assert any("cdlm diffusion_elbo (a bound)" in n and "ar ntp_loss (cross-entropy)" in n for n in got["notes"])
    assert got["likelihood"] == {"ar": {"kind": "exact"}, "cdlm": {"kind": "bound", "samples": 8}}
    assert "NOT A RANKING" in Path(got["files"]["markdown"]).read_text()
    same = compare([str(ar), str(other_ar)], out=str(tmp_path / "out2"))  # two exact runs: no such note
    assert not any("RANKING" in n or "a bound" in n for n in same["notes"])
