"""``ncpctl inspect`` (ncpctl.interpret.concepts): the decomposition of each block's predicted
concept into its codes reconstructs pred exactly; ablation deltas equal a direct re-computation
(pred with the term removed -> coupling -> ``from_decoder_input``); code dictionaries count usage
and lift tokens as defined; bad input is one error line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from ncpctl.checkpoint import load_model
from ncpctl.interpret import concepts as C

from ..conftest import run_cli

torch.set_num_threads(1)
PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser()\n    return parser"


@pytest.fixture(scope="module")
def lm(runs):
    return load_model(runs["concept"])


def _ids(lm, text=PROMPT):
    return torch.tensor(lm.tokenizer.encode(text, add_special_tokens=False).ids)[None]


def test_cli_decomposition_reconstructs_pred(runs, lm):
    r = run_cli("inspect", str(runs["concept"]), "-p", PROMPT, "--top", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    (p,) = json.loads(r.stdout)["prompts"]
    assert lm.config.concept.add == "raw" and p["max_reconstruction_error"] < 1e-5
    k, S, N = lm.config.concept.k, lm.config.n_segments, lm.config.concept.codes
    assert [b["span"] for b in p["blocks"]] == [[j * k, (j + 1) * k] for j in range(p["tokens"] // k)]
    assert p["unpooled_tail"]["tokens"] == p["tokens"] % k  # the trailing partial block, reported
    # each block: S segments, 2 top codes in falling weight, the other N - 2 as the remainder
    view = C.concept_view(lm.model, _ids(lm))
    for b in p["blocks"]:
        assert b["applies_from"] == b["span"][1] - 1  # its closing token first sees it (the shift)
        assert len(b["segments"]) == S
        for seg in b["segments"]:
            w = view.weights[b["block"], seg["segment"]]
            top = [c["weight"] for c in seg["top"]]
            assert top == sorted(top, reverse=True) and top[0] == pytest.approx(float(w.max()), abs=1e-6)
            assert seg["remainder"]["codes"] == N - 2
            assert sum(top) + seg["remainder"]["weight"] == pytest.approx(float(w.sum()), abs=1e-5)
    # the same error by hand: concat over segments of sum_n w * code == the model's pred
    rec = torch.einsum("msn,snd->msd", view.weights.double(), view.codes.double()).reshape(view.pred.shape)
    assert (rec - view.pred.double()).abs().max() < 1e-5


def _direct_delta(lm, ids, start, ab: C.Ablation) -> float:
    """Remove the term by hand: pred -> pred' -> the coupling -> the decoder from z'."""
    model = lm.model
    with torch.no_grad():
        out = model(ids, return_states=True)
        co = out.concept
        pred = co.pred.clone()
        codes = model.concept.codebook()
        ds = codes.shape[-1]
        sl = slice(ab.segment * ds, (ab.segment + 1) * ds)
        w = co.weights[0, ab.block, ab.segment]
        removed = (w[:, None] * codes[ab.segment]).sum(0) if ab.code is None else w[ab.code] * codes[ab.segment, ab.code]
        pred[0, ab.block, sl] -= removed
        h = out.states["encoder"][-1] if out.states["encoder"] else model.embed_tokens(ids, torch.arange(ids.shape[1])[None])
        z = model.concept.coupling(h, pred, co.segments, model.concept.segmenter)
        logits = model.from_decoder_input(z, concept=co)
        base = C._target_logprob(out.logits, ids, start)
        return float(C._target_logprob(logits, ids, start) - base)


def test_ablation_deltas_equal_a_direct_recomputation(lm):
    target = "\n\n"
    ids = torch.cat([_ids(lm), _ids(lm, target)], dim=1)
    start = _ids(lm).shape[1]
    view = C.concept_view(lm.model, ids)
    blocks = C.decompose(view, 2)
    abl = C.default_ablations(blocks, ids.shape[1], 2)
    assert len(abl) == sum(1 for b in blocks if b["applies_from"] <= ids.shape[1] - 2) * lm.config.n_segments * 3
    base, rows = C.ablate(lm.model, ids, start, abl, view, batch=5)
    assert [r["delta"] for r in rows] == sorted(r["delta"] for r in rows)
    by = {(r["block"], r["segment"], r["code"]): r["delta"] for r in rows}
    checked = 0
    for ab in abl[:: max(1, len(abl) // 8)] + [abl[-1]]:
        want = _direct_delta(lm, ids, start, ab)
        assert by[(ab.block, ab.segment, ab.code)] == pytest.approx(want, abs=1e-4), ab
        checked += abs(want) > 1e-4
    assert checked >= 3  # the ablations move the target (a test of nothing would pass with zeros)
    # a block that closes at the last token reaches no prediction: never proposed
    assert all(b["applies_from"] <= ids.shape[1] - 2 for b in blocks if any(a.block == b["block"] for a in abl))


def test_code_dictionary(lm):
    tok = lm.tokenizer
    wins = C.corpus_windows(tok, ["builtin:python-stdlib"], 64, 6)
    assert len(wins) == 6 and all(w.shape == (1, 64) for w in wins)
    decode = lambda ids: tok.decode(ids)  # noqa: E731
    d = C.code_dictionary(lm.model, wins[:4], decode, top_blocks=2, lift_windows=wins[4:], lift_tokens=3)
    S, N, k = lm.config.n_segments, lm.config.concept.codes, lm.config.concept.k
    assert d["blocks"] == 4 * (64 // k)  # every block of a window (the last closes on its last token)
    for s in range(S):  # usage: each block counts once per segment
        assert sum(c["usage"] for c in d["codes"] if c["segment"] == s) == pytest.approx(1.0)
    used = max(d["codes"], key=lambda c: c["usage"])
    ws = [b["weight"] for b in used["top_blocks"]]
    assert ws == sorted(ws, reverse=True) and len(ws) == 2
    # one code's lift tokens by hand: add its vector to the decoder input of the lift windows
    s, n = used["segment"], used["code"]
    model = lm.model
    with torch.no_grad():
        ids = torch.cat(wins[4:])
        e = C.code_direction(model.concept.codebook(), s, n)
        from ncpctl.model.core.interventions import AddToDecoderInput

        plus = torch.log_softmax(model(ids, interventions=[AddToDecoderInput(vector=e)]).logits, -1).mean((0, 1))
        gain = plus - torch.log_softmax(model(ids).logits, -1).mean((0, 1))
    want = gain[: lm.config.vocab_size].topk(3)
    assert [x["id"] for x in used["lift_tokens"]] == want.indices.tolist()
    assert [x["gain"] for x in used["lift_tokens"]] == pytest.approx(want.values.tolist(), abs=1e-4)


def test_cli_dictionary_and_plots(runs, tmp_path):
    r = run_cli("inspect", str(runs["concept"]), "--corpus", "builtin:python-stdlib", "--windows", "3",
                "--seq-len", "32", "--lift-windows", "1", "-p", PROMPT, "--plot", str(tmp_path / "png"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["dictionary"]["windows"] == 3 and res["dictionary"]["seq_len"] == 32
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["code_usage.png", "weights_prompt0.png"]


@pytest.mark.parametrize("args,message", [
    (["-p", "ab"], "shorter than one concept"),
    (["-p", "x y z", "-p", "q r s", "--target", "t"], "--target needs exactly one prompt, got 2"),
    ([], "nothing to inspect"),
])
def test_bad_input(runs, args, message):
    r = run_cli("inspect", str(runs["concept"]), *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_a_model_without_concepts_is_refused(runs):
    r = run_cli("inspect", str(runs["base"]), "-p", PROMPT)
    assert r.returncode == 2 and "neither a concept path (model.concept.enabled) nor a concept bottleneck" in r.stderr


def test_the_human_report_signs_the_remainder_names_the_target_and_the_partial_block():
    """Issue 28: a negative remainder printed as ``+-5.42``, the target's tokens sat under a heading
    naming only the prompt, and a trailing partial block vanished without a word."""
    from rich.console import Console

    from ncpctl.interpret.report_human import human_concepts as _human

    seg = {"segment": 0, "top": [{"code": 3, "weight": 0.5}], "remainder": {"codes": 15, "weight": -5.42}}
    report = {"add": "raw", "prompts": [{
        "prompt": "def f(x):", "tokens": 6, "max_reconstruction_error": 0.0,
        "blocks": [{"block": 0, "text": "def ", "segments": [seg]}],
        "unpooled_tail": {"tokens": 2, "text": "x)"},
        "target": {"text": " return", "logprob": -1.0, "ablations": []}}], "files": []}
    con = Console(record=True, width=200)
    _human(con, report)
    out = con.export_text()
    assert "rest -5.42" in out and "+-" not in out
    assert "+ target ' return'" in out
    assert "the last 2 token(s) 'x)' close no concept yet" in out
