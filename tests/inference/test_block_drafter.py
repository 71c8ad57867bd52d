"""Issue 25 item 2: the block-parallel drafter of NCP-ArchPreview Sec. 5.3 (ncpctl/model/designs/drafter/module.py,
ncpctl/inference/block_drafter.py, the train-drafter stage): Eq. 26's zero gate starts as the
baseline, greedy speculative decoding with it equals plain greedy, decoding feeds it the states it
is trained on, its concept reads only the last complete block of the verified prefix, and a drafter
for another target or tokenizer, or K < 1, is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ncpctl.inference import SamplingParams, generate
from ncpctl.inference.block_drafter import BlockDraftRunner, TargetTap, block_concepts, pool_blocks
from ncpctl.inference.speculative import Speculative
from ncpctl.model.designs.drafter.module import BlockDrafter, DrafterConfig
from ncpctl.train.designs.drafter import DraftTraining

from ..conftest import run_cli
from ..model._helpers import build, tiny
from .test_speculative import ARCHPREVIEW

FIXED = lambda: tiny("neox", concept=dict(k=3))  # noqa: E731
RAGGED = [[5, 17, 3, 99, 42, 7, 1], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def _drafter(target, seed: int = 0, gate: float = 0.0, **kw) -> BlockDrafter:
    torch.manual_seed(seed)
    d = BlockDrafter(DrafterConfig.for_target(target.cfg, **kw)).to(target.embed.weight.dtype)
    if d.inject is not None:
        with torch.no_grad():
            for m in d.inject:
                m.gate.normal_(0, gate)
    return d.eval()


def test_zero_gate_at_init_makes_the_concept_drafter_the_baseline():
    """Same seed: the same weights (the injection is built last) and, with tanh(0) = 0, exactly the
    same states and the same training loss on the same anchors; a moved gate changes them."""
    target = build(FIXED())
    base, plus = _drafter(target, k=4), _drafter(target, k=4, concept_injection=True)
    common = plus.state_dict()
    assert all(torch.equal(v, common[k]) for k, v in base.state_dict().items())
    N, W, L, d = 5, 6, 3, target.cfg.d_model
    feats, x = torch.randn(N, W, L * d), torch.randn(N, d)
    pos, valid = torch.arange(W)[None].expand(N, W) + 2, torch.ones(N, W, dtype=torch.bool)
    assert torch.equal(base(feats, pos, valid, x), plus(feats, pos, valid, x, torch.randn(N, d)))
    batch = torch.randint(0, 200, (2, 25))
    losses = []
    for c in (False, True):
        torch.manual_seed(1)
        tr = DraftTraining(target, DrafterConfig.for_target(target.cfg, k=4, window=8, concept_injection=c), 6)
        tr.drafter.load_state_dict(base.state_dict(), strict=False)
        torch.manual_seed(2)
        losses.append(tr(batch[:, :-1], batch[:, 1:]).loss)
    assert torch.equal(losses[0], losses[1])
    with torch.no_grad():
        plus.inject[0].gate.fill_(0.5)
    assert not torch.allclose(base(feats, pos, valid, x), plus(feats, pos, valid, x, torch.randn(N, d)))


@pytest.mark.parametrize("name,how", [("fixed", dict()), ("fixed", dict(concept_injection=True, concept_source="pooled")),
                                      ("fixed", dict(concept_injection=True, concept_source="predicted")),
                                      ("archpreview", dict(concept_injection=True))])
def test_greedy_speculative_with_the_block_drafter_equals_plain_greedy(name, how):
    """Ragged float64 batch, K = 3 of a 4-slot drafter; then the drafter's per-slot states are the
    target's full-forward states of the committed tokens (decoding reads what training reads),
    also through IRC / CRC and sliding windows (the ArchPreview design)."""
    target = build(FIXED() if name == "fixed" else ARCHPREVIEW(), scale=0.2).double()
    drafter = _drafter(target, k=4, gate=1.0, **how).double()
    params = SamplingParams(max_new_tokens=20, greedy=True)
    plain = [c.tokens for c in generate(target, RAGGED, params, str)]
    spec = Speculative(BlockDraftRunner(target, drafter), 3)
    got = [c.tokens for c in generate(target, RAGGED, params, str, speculative=spec)]
    assert got == plain
    assert not target.decoder._forward_hooks and not target.encoder._forward_pre_hooks  # hooked for the call only
    st = spec.stats.as_dict()
    assert st["rounds"] < 3 * 20 and 1.0 <= st["mal"] <= 4.0, st
    run, cfg = spec.drafter, drafter.cfg
    tap = TargetTap(target, cfg.target_layers)
    c_decoding = run._concept(torch.tensor(run.last))  # (B, d) what the next round would inject
    for b, prompt in enumerate(RAGGED):
        seen = run.last[b] - int(run.pad[b]) + 1  # committed tokens the drafter holds states of
        seq = torch.tensor([(prompt + got[b])[:seen]])
        with torch.no_grad():
            out = target(seq, compute_logits=False)
        feats, h = tap.take()
        lo = int(run.pad[b])
        assert torch.allclose(run.F[b, lo : lo + seen], feats[0], atol=1e-10)
        assert torch.allclose(run.H[b, lo : lo + seen], h[0], atol=1e-10)
        # the context keys and values cached per committed token are those of the whole window at once
        for cache, pair in zip(run.KV, drafter.context(feats, torch.arange(seen)[None])):
            for c, t in zip(cache, pair):
                assert torch.allclose(c[b, :, lo : lo + seen], t[0], atol=1e-10)
        if cfg.concept_injection:  # the training forward's concept at this anchor (the last verified position)
            k = cfg.concept_k
            per_block = out.concept.pred if cfg.concept_source == "predicted" else pool_blocks(h, k)
            assert torch.allclose(c_decoding[b], block_concepts(per_block, torch.tensor([[seen - 1]]), k)[0, 0],
                                  atol=1e-10)
    tap.close()


def test_the_concept_reads_only_the_last_complete_block_of_the_verified_prefix():
    target = build(FIXED(), scale=0.2).double()
    k, T = 3, 14
    x = torch.randint(0, 200, (1, T))
    tap = TargetTap(target, [0])

    def concepts(seq, a):
        with torch.no_grad():
            out = target(seq, compute_logits=False)
        _, h = tap.take()
        anchors = torch.tensor([[a]])
        return block_concepts(pool_blocks(h, k), anchors, k)[0, 0], block_concepts(out.concept.pred, anchors, k)[0, 0]

    for a in (1, 2, 7, 10):  # last verified position; its last complete block ends at ((a+1)//k)*k - 1
        end = (a + 1) // k * k
        pooled, pred = concepts(x, a)
        later = x.clone()
        later[0, end:] = (later[0, end:] + 1) % 200  # every token after the block, the verified ones too
        assert torch.equal(concepts(later, a)[0], pooled) and torch.equal(concepts(later, a)[1], pred)
        if end == 0:
            assert not pooled.any() and not pred.any()  # no complete block yet: zeros
        else:
            inside = x.clone()
            inside[0, end - 1] = (inside[0, end - 1] + 1) % 200
            assert not torch.allclose(concepts(inside, a)[0], pooled)
    tap.close()


def _drafter_checkpoint(tmp: Path, target_cfg, tokenizer: Path | None, **kw) -> str:
    from ncpctl.checkpoint import save_model_files

    d = BlockDrafter(DrafterConfig.for_target(target_cfg, **kw))
    save_model_files(tmp, {f"drafter.{k}": v for k, v in d.state_dict().items()}, step=1, tokens_seen=0,
                     recipe=None, tokenizer_path=tokenizer,
                     extra={"model_config": target_cfg.to_dict(), "drafter": {"config": d.cfg.to_dict()}})
    return str(tmp)


def test_refusals_another_target_another_tokenizer_and_k_below_one(tmp_path):
    from ncpctl.checkpoint import load_model, save_model_files
    from ncpctl.errors import UserError
    from ncpctl.inference.drafters import load_speculative

    from .test_speculative import TOKENIZER

    cfg = tiny("llama", vocab_size=320, max_seq_len=64, concept=dict(k=4))
    save_model_files(tmp_path / "target", build(cfg), step=0, tokens_seen=0, recipe=None, tokenizer_path=TOKENIZER)
    target = str(tmp_path / "target")
    good = _drafter_checkpoint(tmp_path / "good", cfg, TOKENIZER, k=4, concept_injection=True)
    wide = _drafter_checkpoint(tmp_path / "wide", tiny("llama", vocab_size=320, d_model=48), TOKENIZER)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.add_special_tokens(["<|other|>"])
    tok.save(str(tmp_path / "other.json"))
    other = _drafter_checkpoint(tmp_path / "other", cfg, tmp_path / "other.json")
    # an edited checkpoint: the weights of a drafter without injection under a config with it
    plain_weights = BlockDrafter(DrafterConfig.for_target(cfg, k=4)).state_dict()
    injecting = DrafterConfig.for_target(cfg, k=4, concept_injection=True)
    save_model_files(tmp_path / "mixed", {f"drafter.{k}": v for k, v in plain_weights.items()}, step=1,
                     tokens_seen=0, recipe=None, tokenizer_path=TOKENIZER,
                     extra={"model_config": cfg.to_dict(), "drafter": {"config": injecting.to_dict()}})
    nocon = tiny("llama", vocab_size=320, max_seq_len=64)  # same shape, no concept path
    save_model_files(tmp_path / "plain", build(nocon), step=0, tokens_seen=0, recipe=None, tokenizer_path=TOKENIZER)
    loaded = load_model(target)
    spec, info = load_speculative(loaded, good, 4)
    assert info["concept_source"] == "pooled" and spec.drafter.max_tokens == 4
    for ck, args, msg in ((target, (wide, 4), r"another target: d_model 48 \(target 32\)"),
                          (target, (other, 4), "another tokenizer"),
                          (str(tmp_path / "plain"), (good, 4), "injects concepts of fixed blocks"),
                          (target, (good, 0), "--draft-tokens must be >= 1"),
                          (target, (str(tmp_path / "mixed"), 4), "mixed: its weights do not fit the drafter")):
        with pytest.raises(UserError, match=msg) as e:
            load_speculative(load_model(ck), *args)
        assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0]
    r = run_cli("eval", target, "--speculative", wide, "--prompts", str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "another target" in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_a_predicted_concept_is_the_same_tensor_in_training_and_decoding_on_a_normed_target():
    """Issue 41 item 7: with ``concept.add: normed`` (the GPT-2 recipes) decoding injects the term the
    coupling adds, norm(pred); training read the raw pred (up to 8.44 apart). The c that the training
    forward hands the drafter at each anchor a is the c decoding injects after the prompt x[..a]."""
    target = build(tiny("gpt2", concept=dict(k=3, encoder_layers=0, add="normed")), scale=0.2).double()
    tr = DraftTraining(target, DrafterConfig.for_target(target.cfg, k=2, window=4, concept_injection=True,
                                                        concept_source="predicted"), anchors=8).double()
    seen = []
    tr.drafter.register_forward_pre_hook(lambda m, args: seen.append((args[1][:, -1], args[4])))  # (N,) anchors, (N, d)
    torch.manual_seed(0)
    x = torch.randint(0, 200, (1, 21))
    tr(x[:, :-1], x[:, 1:])
    anchors, c_train = seen[0]
    assert len(anchors) == 8 and (anchors >= 3).sum() >= 4  # some anchors after a complete block
    for a, c in zip(anchors.tolist(), c_train):
        _, st = target.prefill(x[:, : a + 1], [a + 1], max_len=32)
        assert torch.allclose(st.pred[0], c, atol=1e-10), a  # BlockDraftRunner._concept returns st.pred
    assert (c_train.norm(dim=-1) > 0).any()


def test_a_predicted_concept_needs_a_coupling_that_adds_one():
    from ncpctl.inference.block_drafter import check_target

    target = build(tiny("llama", concept=dict(k=3, coupling="cross_attention")))
    cfg = DrafterConfig.for_target(target.cfg, k=2, concept_injection=True, concept_source="predicted")
    assert "the target's coupling adds none" in check_target(target, cfg, "the drafter")
    assert check_target(target, DrafterConfig.for_target(target.cfg, k=2, concept_injection=True), "d") is None
