"""DLCM Fig. 7 (loss by position within the concept) and Table 5 (tokens per concept per corpus):
ncpctl/evaluate/concept_position.py against a direct reference on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ncpctl.evaluate.concept_position import compression_by_source, loss_by_concept_position, positions_in_concept
from tests.model._helpers import build, tiny, tokens


def _dlcm():
    cfg = tiny("llama", concept={"segmentation": "dynamic", "coupling": "cross_attention", "ncp_weight": 0.0,
                                 "vq_weight": 0.0, "target_ratio": 3})
    model = build(cfg, seed=0, scale=0.3)
    with torch.no_grad():  # boundaries that vary: W_q, W_k away from the identity
        seg = model.concept.segmenter
        seg.q.weight.add_(torch.randn_like(seg.q.weight))
    return model


def test_positions_in_concept_from_the_segment_index():
    closed = torch.tensor([[0, 0, 0, 1, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1]])
    assert positions_in_concept(closed).tolist() == [[1, 2, 3, 1, 1, 2, 1], [1, 1, 2, 3, 4, 5, 6]]


def _reference(model, base, xs, K):
    """Per token: its boundary b_t = [p_t >= 0.5] (b_0 = 1), its position since the last boundary,
    its NLL from the previous position's logits; grouped by hand."""
    rows = {k: ([], []) for k in range(1, K + 1)}
    tokens_seen = starts = 0
    for x in xs:
        seg = model.concept.segmenter
        h = model.encode(model.embed_tokens(x, model.token_context(x.shape[1], x.device, torch.float32)[1]),
                         model.token_context(x.shape[1], x.device, torch.float32)[0])
        p = seg.probabilities(h)
        for i in range(x.shape[0]):
            lg, lb = model(x[i:i + 1]).logits[0], base(x[i:i + 1]).logits[0]
            pos = 0
            for t in range(x.shape[1]):
                pos = 1 if t == 0 or p[i, t] >= 0.5 else pos + 1
                tokens_seen += 1
                starts += pos == 1
                if t and pos <= K:
                    v = model.cfg.vocab_size
                    rows[pos][0].append(float(F.cross_entropy(lg[t - 1, :v][None], x[i, t][None])))
                    rows[pos][1].append(float(F.cross_entropy(lb[t - 1, :v][None], x[i, t][None])))
    return rows, tokens_seen / starts


def test_loss_by_concept_position_matches_a_direct_reference():
    model = _dlcm()
    base = build(tiny("llama"), seed=1)
    xs = [tokens(model.cfg, 3, 40, seed=s) for s in (1, 2)]
    K = 6
    with torch.no_grad():
        got = loss_by_concept_position(model, xs, base=base, max_position=K)
        rows, tpc = _reference(model, base, xs, K)
    assert got.positions == list(range(1, K + 1))
    assert got.counts == [len(rows[k][0]) for k in got.positions] and sum(got.counts) > 0
    for k in got.positions:
        if rows[k][0]:
            assert got.dlcm[k - 1] == pytest.approx(sum(rows[k][0]) / len(rows[k][0]), rel=1e-5)
            assert got.base[k - 1] == pytest.approx(sum(rows[k][1]) / len(rows[k][1]), rel=1e-5)
            assert got.delta[k - 1] == pytest.approx(got.dlcm[k - 1] - got.base[k - 1], abs=1e-6)
        else:
            assert math.isnan(got.dlcm[k - 1])
    assert got.tokens_per_concept == pytest.approx(tpc)
    assert 1 < got.tokens_per_concept < 40  # the random predictor cuts some, not all, positions
    assert not model.training and set(got.to_dict()) >= {"positions", "dlcm", "base", "delta", "counts"}


def test_compression_by_source_is_tokens_over_concepts():
    model = _dlcm()
    corpora = {"a": [tokens(model.cfg, 2, 30, seed=3)], "b": [tokens(model.cfg, 2, 30, seed=4), tokens(model.cfg, 1, 17)]}
    got = compression_by_source(model, corpora)
    for name, xs in corpora.items():
        ref = loss_by_concept_position(model, xs, max_position=1)
        assert got[name]["tokens"] == sum(x.numel() for x in xs)
        assert got[name]["tokens_per_concept"] == pytest.approx(ref.tokens_per_concept)
        assert got[name]["tokens"] / got[name]["concepts"] == pytest.approx(got[name]["tokens_per_concept"])


def test_a_model_without_dynamic_segments_is_refused():
    base = build(tiny("llama"), seed=1)
    with pytest.raises(ValueError, match="dynamic"):
        loss_by_concept_position(base, [tokens(base.cfg, 1, 8)])


def test_eval_concepts_through_the_cli(tmp_path):
    """``ncpctl eval CKPT --concepts --heldout A --heldout B --base BASE``: Table 5's rows per corpus
    and Fig. 7's 20 positions, in concepts.json and on stdout (--json)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ncpctl.checkpoint import save_model_files
    from tests.conftest import run_cli

    prose = tmp_path / "prose.txt"
    prose.write_text("the quick brown fox jumps over the lazy dog and runs far away into the woods\n" * 30)
    code = tmp_path / "code.py"
    code.write_text("def f(x):\n    return [i * x for i in range(10) if i % 2]\n" * 30)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(prose), str(code)], trainers.BpeTrainer(vocab_size=180, special_tokens=["<|endoftext|>", "[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    ck, base_ck = tmp_path / "dlcm", tmp_path / "base"
    for path, model in ((ck, _dlcm()), (base_ck, build(tiny("llama"), seed=1))):
        save_model_files(path, model, step=1, tokens_seen=0, recipe=None, tokenizer_path=tmp_path / "tokenizer.json")
    r = run_cli("eval", str(ck), "--concepts", "--heldout", f"{{path: {prose}, label: prose}}", "--heldout",
                f"{{path: {code}, label: code}}", "--base", str(base_ck), "--out", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    saved = json.loads((tmp_path / "out" / "concepts.json").read_text())
    assert set(res["tokens_per_concept_by_source"]) == {"prose", "code"} == set(saved["tokens_per_concept_by_source"])
    for row in saved["tokens_per_concept_by_source"].values():
        assert row["tokens"] > 0 and row["tokens_per_concept"] == pytest.approx(row["tokens"] / row["concepts"])
    f7 = saved["loss_by_concept_position"]
    assert f7["positions"] == list(range(1, 21)) and f7["counts"][0] > 0 and f7["base"] is not None
    assert saved["target_ratio"] == 3 and saved["seq_len"] == 64
    bad = run_cli("eval", str(base_ck), "--concepts", "--heldout", str(prose))
    assert bad.returncode == 2 and "segmentation: dynamic" in bad.stderr
