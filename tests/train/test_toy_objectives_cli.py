"""A toy objective added through the public API only (tests/model/toy_objectives.py: masked
blocks with a block-causal attention pattern, the toy furthest from next-token prediction; named
in the recipe by import path, as a user's would be) trains, evaluates and generates through the
real ``ncpctl`` entry point: ``pretrain`` logs its own loss key in training and validation,
``eval`` scores lm-eval tasks through its ``score`` (log-likelihood) and ``decoding``
(generate_until), and ``generate`` produces the tokens its decoding rule picks (checked against
full forwards of the saved checkpoint here); ``export`` refuses it (a Hugging Face causal LM
predicts the next token). The checkpoint names the objective, so opening it
imports the toy only when the user names it too (``--strategy``). The two-ahead toy's
generation and scoring are checked in-process (tests/model/test_objectives.py,
tests/evaluate/test_lm_objective.py): a second CLI run would cost ~30 s more."""

from __future__ import annotations

import json
import math

import torch

from tests.conftest import REPO

from .conftest import metrics, ncpctl, result

ENV = {"PYTHONPATH": str(REPO)}
PATH = "tests.model.toy_objectives:MaskedBlocks"


def _greedy_rule(model, prompt: list[int], n_new: int) -> list[int]:
    """The tokens the objective's decoding must pick: each from the first mask of the current
    block, one full forward per token."""
    from tests.model.toy_objectives import BLOCK

    V, m, seq, want = model.cfg.vocab_size, model.objective.mask_id, list(prompt), []
    with torch.no_grad():
        for _ in range(n_new):
            n = len(seq)
            logits = model(torch.tensor(seq + [m] * (BLOCK - n % BLOCK))[None]).logits[0, n]
            want.append(int(logits[:V].argmax()))
            seq.append(want[-1])
    return want


def test_toy_objective_trains_evaluates_and_generates_through_the_cli(make_recipe, tmp_path) -> None:
    name, path, key = "masked", PATH, "masked_loss"
    sets = ["--set", f"model.objective={path}", "--set", "model.concept.enabled=false", "--set", "train.max_steps=2",
            "--set", "train.eval_every=2", "--set", "train.save_every=2", "--set", "model.pad_vocab_multiple=1024"]
    run = result(ncpctl("pretrain", str(make_recipe(name)), "--json", *sets, env=ENV))
    train, val = metrics(tmp_path / name), metrics(tmp_path / name, "val")
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r[key]) for r in train + val) and val
    assert "ntp_loss" not in train[-1]
    ck = run["checkpoint"]

    refused = ncpctl("eval", ck, "--tasks", "ncp_cloze", "--limit", "2", env=ENV)
    assert refused.returncode == 2 and "--strategy" in refused.stderr  # a checkpoint's import path is not run
    ev = result(ncpctl("eval", ck, "--tasks", "ncp_cloze,ncp_last_ident", "--limit", "2", "--strategy", path,
                       "--json", env=ENV))
    assert 0.0 <= ev["results"]["ncp_cloze"]["acc"] <= 1.0 and "exact_match" in ev["results"]["ncp_last_ident"]

    gen = result(ncpctl("generate", ck, "-p", "def main(", "-n", "5", "--greedy", "--json", "--strategy", path,
                        env=ENV))["completions"][0]

    from ncpctl.checkpoint import load_model
    from ncpctl.model.core.config import trust

    trust(path)
    loaded = load_model(ck)
    prompt = loaded.tokenizer.encode("def main(", add_special_tokens=False).ids
    want = _greedy_rule(loaded.model.eval(), prompt, 5)[: gen["tokens"]]
    if gen["finish_reason"] == "eod":
        want = want[:-1]
    assert gen["tokens"] >= 1 and gen["text"] == loaded.tokenizer.decode(want, skip_special_tokens=False)

    exp = ncpctl("export", ck, "--out", str(tmp_path / "hf"), "--strategy", path, env=ENV)
    assert exp.returncode == 2 and "model.objective" in exp.stderr and not (tmp_path / "hf" / "config.json").exists()
