"""The lm-eval adapter: exact scoring (vs lone full forwards and vs lm-eval's `hf` backend on
the exported model), offline tasks in-process, through the `lm_eval` command line, and the
one-line error for a hub task that cannot load its data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance

from ncpctl.errors import UserError
from ncpctl.evaluate.lm import NCPLM
from ncpctl.evaluate.run import evaluate, resolve_target

from ..conftest import run_cli
from ._fixtures import own_copy

torch.set_num_threads(1)


def _requests(n: int = 12):
    ctx = "def parse(self, text):\n    result = []\n    for line in text.splitlines():\n"
    conts = ["        result.append(line)\n", "        if not line:\n", "    return None\n", "        pass\n"]
    reqs = [Instance("loglikelihood", {}, (ctx[: 20 + 7 * i], conts[i % 4]), i) for i in range(n)]
    reqs.append(Instance("loglikelihood", {}, ("", "import os\n"), n))  # empty context -> EOT prefix
    reqs.append(Instance("loglikelihood", {}, (ctx + " ", "  x = 1"), n + 1))  # trailing space moves
    return reqs


@pytest.mark.parametrize("kind", ["concept", "base"])
def test_batched_scores_equal_lone_full_forwards(runs, kind):
    lm = NCPLM(str(runs[kind]), batch_size=5)
    reqs = _requests()
    got = lm.loglikelihood(reqs)
    model, V = lm.model, lm.cfg.vocab_size
    for req, (ll, greedy) in zip(reqs, got):
        ctx, cont = req.args
        if ctx == "":
            c_ids, t_ids = [lm.eot_token_id], lm.tok_encode(cont)
        else:
            n = len(ctx) - len(ctx.rstrip())
            ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
            whole, c_ids = lm.tok_encode(ctx + cont), lm.tok_encode(ctx)
            t_ids = whole[len(c_ids):]
        seq = torch.tensor([c_ids + t_ids])
        with torch.no_grad():
            logp = model(seq[:, :-1]).logits[0, -len(t_ids):, :V].log_softmax(-1)
        ref = logp.gather(1, torch.tensor(t_ids)[:, None]).sum().item()
        assert abs(ll - ref) <= 1e-4, (req.args, ll, ref)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(t_ids)).all())


def test_loglikelihood_equals_lm_eval_hf_backend(runs, tmp_path):
    """Ours on the checkpoint == lm-eval's HFLM on the exported GPTNeoXForCausalLM (<= 1e-4)."""
    from lm_eval.models.huggingface import HFLM

    from ncpctl.interop.hf_export import export

    out = tmp_path / "hf"
    export(runs["base"], out)
    ours = NCPLM(str(runs["base"]), batch_size=4)
    hf = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=4)
    reqs = _requests()
    a, b = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    for (la, ga), (lb, gb), r in zip(a, b, reqs):
        assert abs(la - lb) <= 1e-4 and ga == gb, (r.args, la, lb)
    text = [Instance("loglikelihood_rolling", {}, ("x = 1\n" * 90 + "def f():\n    return x\n",), 0)]
    ra, rb = ours.loglikelihood_rolling(text), hf.loglikelihood_rolling(text)
    assert abs(ra[0] - rb[0]) <= 1e-4, (ra, rb)  # > max_length: several windows


def test_generate_until_is_greedy_full_forward(runs):
    """Incremental decoding (ConceptLM) == argmax of a full recompute at every step."""
    lm = NCPLM(str(runs["concept"]), batch_size=3)
    ctxs = ["def main(", "import os\nimport sys\n\n\nclass Reader", "x"]
    reqs = [Instance("generate_until", {}, (c, {"until": ["\n\n\n"], "max_gen_toks": 9}), i) for i, c in enumerate(ctxs)]
    outs = lm.generate_until(reqs)
    for c, o in zip(ctxs, outs):
        ids = lm.tok_encode(c)
        for _ in range(9):
            with torch.no_grad():
                nxt = int(lm.model(torch.tensor([ids])).logits[0, -1, : lm.cfg.vocab_size].argmax())
            if nxt == lm.eot_token_id:
                break
            ids.append(nxt)
        ref = lm.tok_decode(ids[len(lm.tok_encode(c)):])
        assert o == ref.split("\n\n\n")[0], (c, o, ref)


def test_offline_tasks_in_process(runs, tmp_path):
    t = resolve_target(str(own_copy(runs, "concept", tmp_path / "run")), [], ["ncp_offline"], 8, 6, None, None)
    s = evaluate(t)
    assert set(s["results"]) == {"ncp_heldout_ppl", "ncp_cloze", "ncp_last_ident"}
    ppl = s["results"]["ncp_heldout_ppl"]
    assert 1.0 < ppl["token_perplexity"] < 1024 and ppl["bits_per_byte"] > 0  # better than uniform over 1024
    assert 0.0 <= s["results"]["ncp_cloze"]["acc"] <= 1.0 and "exact_match" in s["results"]["ncp_last_ident"]
    p = s["perplexity"]
    assert p["per_set"]["ncp_heldout_ppl"]["token_perplexity"] == pytest.approx(ppl["token_perplexity"], rel=1e-6)
    assert p["mean_of_sets"] == pytest.approx(p["token_weighted"])  # one set
    written = json.loads(open(s["files"]["json"]).read())
    assert "ncp_cloze" in written["results"] and "perplexity" in written
    md = open(s["files"]["markdown"]).read()
    assert "ncp_heldout_ppl" in md and "token-weighted" in md and "mean of per-set" in md


def test_cli_eval_recipe_json(runs, tmp_path):
    """The real entry point with a recipe: its eval section (tasks: [ncp_offline], limit 8)."""
    r = run_cli("eval", str(own_copy(runs, "recipe", tmp_path / "run")), "--limit", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert "it/s]" not in r.stderr and "%|" not in r.stderr, r.stderr  # issue 46 item 10: no lm-eval bars
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["command"] == "eval" and out["limit"] == 4
    assert "ncp_cloze" in out["results"] and out["perplexity"]["token_weighted"] > 1
    assert out["files"]["json"].endswith(".json")


def test_hub_task_fails_with_one_line_naming_it(runs, tmp_path):
    ck = own_copy(runs, "concept", tmp_path / "run")
    r = run_cli("eval", str(ck), "--tasks", "arc_easy,ncp_cloze", "--limit", "2")
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "arc_easy" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_through_the_lm_eval_command_line(runs, tmp_path):
    """lm-eval's own CLI (`python -m ncpctl.evaluate` = lm_eval with --model ncpctl registered)."""
    ck = own_copy(runs, "concept", tmp_path / "run")  # the offline tasks' files are written into the run
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "ncpctl.evaluate", "run", "--model", "ncpctl", "--model_args",
                        f"checkpoint={ck}", "--tasks", "ncp_offline", "--limit", "3", "--device", "cpu",
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert files
    res = json.loads(files[0].read_text())["results"]
    assert {"ncp_heldout_ppl", "ncp_cloze", "ncp_last_ident"} <= set(res)
    bad = subprocess.run([sys.executable, "-m", "ncpctl.evaluate", "run", "--model", "ncpctl", "--model_args",
                          f"checkpoint={ck}", "--batch_size", "lots", "--tasks", "ncp_offline",
                          "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "error: batch_size='lots': expected a positive integer or auto" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("kind", ["concept", "base"])
def test_shared_input_different_targets_are_scored_apart(runs, kind):
    """One-token answers to one question have the same model input and differ only in the
    target: each must get its own score (not the first one's), equal to a lone full forward.
    Rows of several lengths (not multiples of k) share a right-padded batch."""
    lm = NCPLM(str(runs[kind]), batch_size=4)
    ctxs = [[5, 17, 33, 2, 9, 41, 7], [5, 17, 33], [8, 8, 8, 8, 8, 8, 8, 8, 8, 12, 3]]
    reqs = [(None, c, [t]) for c in ctxs for t in (11, 12, 13, 11)]  # the last one repeats the first
    reqs += [(None, ctxs[0], [2, 9]), (None, ctxs[0][:-1], [7, 30])]  # multi-token, overlapping inputs
    got = lm._loglikelihood_tokens(reqs)
    for (_, ctx, cont), (ll, greedy) in zip(reqs, got):
        with torch.no_grad():
            logp = lm.model(torch.tensor([ctx + cont[:-1]])).logits[0, -len(cont):, : lm.cfg.vocab_size]
        logp = logp.log_softmax(-1)
        ref = logp.gather(1, torch.tensor(cont)[:, None]).sum().item()
        assert abs(ll - ref) <= 1e-4, (ctx, cont, ll, ref)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())
    assert len({round(ll, 6) for ll, _ in got[:3]}) == 3  # three targets, three scores


def test_perplexity_summary_labels_both_averages():
    """Two sets as the paper has them (wikitext: word perplexity; LAMBADA: target perplexity):
    the mean of the sets' own lm-eval perplexities, and the token-weighted one from our NLLs."""
    import math

    from ncpctl.evaluate.run import perplexity_summary

    results = {"wikitext": {"word_perplexity,none": 30.0, "byte_perplexity,none": 1.9, "alias": "wikitext"},
               "lambada_openai": {"perplexity,none": 10.0, "perplexity_stderr,none": 0.5, "acc,none": 0.4},
               "arc_easy": {"acc,none": 0.5}}
    stats = {"wikitext": {"nll": 300.0, "tokens": 100}, "lambada_openai": {"nll": 20.0, "tokens": 10},
             "arc_easy": {"nll": 5.0, "tokens": 4}}
    p = perplexity_summary(results, stats)
    assert set(p["per_set"]) == {"wikitext", "lambada_openai"}
    assert p["per_set"]["wikitext"]["metric"] == "word_perplexity" and p["per_set"]["wikitext"]["value"] == 30.0
    assert p["per_set"]["lambada_openai"]["metric"] == "perplexity"
    assert p["per_set"]["lambada_openai"]["token_perplexity"] == pytest.approx(math.exp(2.0))
    assert p["mean_of_sets"] == pytest.approx(20.0)  # (30 + 10) / 2, the paper's average
    assert p["token_weighted"] == pytest.approx(math.exp(320.0 / 110))


def test_model_args_are_checked_before_loading(runs):
    assert NCPLM(str(runs["base"]), batch_size="auto").batch_size == 8
    assert NCPLM(str(runs["base"]), batch_size="3").batch_size == 3
    for bad in ("0", "eight", "-2"):
        with pytest.raises(UserError, match="batch_size"):
            NCPLM(str(runs["base"]), batch_size=bad)
    with pytest.raises(UserError, match="dtype='float64'"):
        NCPLM("/nonexistent", dtype="float64")  # named before the checkpoint is even opened
