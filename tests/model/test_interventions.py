"""Interventions (ncpctl/model/core/interventions.py): each kind is honoured identically by the
full forward and by incremental decoding (ragged batch), does what it says (a code edit
removes exactly that code's term from pred; additions land where and when they should), and
the decoder re-run from a forward's decoder input reproduces its logits."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model import AddToDecoderInput, AddToResidual, CodeEdit

from . import toys  # noqa: F401  (registers the toy designs)
from ._helpers import build, check_cached_decode, ragged_batch, tiny, tokens

MODELS = {
    "conceptlm-neox": tiny("neox", concept={}),
    "archpreview-like-llama": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2, concept=dict(
        k=3, code_weights="softmax", add="normed")),
    "toy-alternating-2-3": tiny("neox", concept=dict(segmentation="alt23")),
}


def _kinds(cfg):
    g = torch.Generator().manual_seed(3)
    S, N, d = cfg.n_segments, cfg.concept.codes, cfg.d_model
    scale = torch.ones(S, N)
    scale[0, :3] = 0.0  # ablate three codes of segment 0
    scale[2] = 2.0
    return {
        "code-edit": [CodeEdit(start=1, length=2, scale=scale, shift=0.05 * torch.randn(S, N, generator=g))],
        "decoder-input": [AddToDecoderInput(start=3, length=5, vector=torch.randn(d, generator=g))],
        "residual-decoder": [AddToResidual(stack="decoder", layer=-1, start=2, vector=torch.randn(d, generator=g))],
        "residual-encoder": [AddToResidual(stack="encoder", layer=0, start=4, length=3,
                                           vector=torch.randn(d, generator=g))],
        "all-at-once": [CodeEdit(scale=scale), AddToDecoderInput(start=6, vector=torch.randn(d, generator=g)),
                        AddToResidual(stack="decoder", layer=0, vector=torch.randn(d, generator=g), rows=[0, 2])],
    }


@pytest.mark.parametrize("kind", ["code-edit", "decoder-input", "residual-decoder", "residual-encoder", "all-at-once"])
@pytest.mark.parametrize("name", list(MODELS))
def test_intervened_cached_decode_equals_intervened_full_forward(name, kind):
    cfg = MODELS[name]
    model = build(cfg, scale=0.2).double()
    ivs = _kinds(cfg)[kind]
    lengths = [5, 2, 7, 4]
    n_new, Tp = 11, 7
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    with torch.no_grad():
        def alone(b, n, interventions):  # row b by itself: the row selection follows it
            own = [_only_row(iv, b) for iv in interventions]
            return model(seqs[b : b + 1, : n + n_new], interventions=[iv for iv in own if iv is not None]).logits[0]

        full = [alone(b, n, ivs) for b, n in enumerate(lengths)]
        plain = [alone(b, n, []) for b, n in enumerate(lengths)]
        assert any((f - p).abs().max() > 1e-3 for f, p in zip(full, plain))  # the intervention acts
    check_cached_decode(model, seqs, prompt, lengths, full, 1e-9, max_len=Tp + n_new, interventions=ivs)


def _only_row(iv, b):
    """The intervention as it applies to batch row b run alone (None: not to that row)."""
    import dataclasses

    if iv.rows is not None and b not in iv.rows:
        return None
    return dataclasses.replace(iv, rows=None)


def test_a_code_edit_removes_exactly_that_codes_term():
    cfg = MODELS["archpreview-like-llama"]
    model = build(cfg, scale=0.3)
    x = tokens(cfg, 2, 13)
    s, n, j = 1, 5, 2  # code n of segment s, at concept j only
    scale = torch.ones(cfg.n_segments, cfg.concept.codes)
    scale[s, n] = 0.0
    with torch.no_grad():
        ref = model(x)
        got = model(x, interventions=[CodeEdit(start=j, length=1, scale=scale)])
        codes = model.concept.codebook()  # (S, N, ds)
    w, ds = ref.concept.weights, cfg.segment_dim
    want = ref.pred.clone()
    want[:, j, s * ds : (s + 1) * ds] -= w[:, j, s, n, None] * codes[s, n]  # that term, in its slice of d
    torch.testing.assert_close(got.pred, want, rtol=0, atol=1e-6)
    assert torch.equal(got.pred[:, :j], ref.pred[:, :j]) and torch.equal(got.pred[:, j + 1 :], ref.pred[:, j + 1 :])
    # pred is the exact mix of its code weights: the decomposition a `verify` checks
    mix = torch.einsum("bmsn,snd->bmsd", ref.concept.weights, codes).reshape(ref.pred.shape)
    torch.testing.assert_close(mix, ref.pred, rtol=0, atol=1e-6)
    # tokens before the first one that receives pred[j] are unchanged, that token is not (k=3)
    first = 3 * (j + 1) - 1
    assert torch.equal(got.logits[:, :first], ref.logits[:, :first])
    assert (got.logits[:, first] - ref.logits[:, first]).abs().max() > 1e-4


def test_additions_land_where_they_should():
    cfg = MODELS["conceptlm-neox"]
    model = build(cfg, scale=0.3)
    x = tokens(cfg, 2, 12)
    v = torch.randn(2, cfg.d_model)  # per row
    iv = AddToDecoderInput(start=4, length=3, vector=v)
    with torch.no_grad():
        ref = model(x)
        got = model(x, interventions=[iv])
        z = ref.concept.z.clone()
        z[:, 4:7] += v[:, None]
        again = model.from_decoder_input(z, concept=ref.concept)
        assert torch.equal(model.from_decoder_input(ref.concept.z, concept=ref.concept), ref.logits)
    torch.testing.assert_close(again, got.logits, rtol=0, atol=1e-6)
    assert torch.equal(got.logits[:, :4], ref.logits[:, :4])
    assert (got.logits[:, 4] - ref.logits[:, 4]).abs().max() > 1e-4


def test_bad_interventions_are_refused():
    model = build(MODELS["conceptlm-neox"])
    x = tokens(model.cfg, 1, 8)
    with pytest.raises(ValueError, match="no layer 5 in stack 'encoder'"):
        model(x, interventions=[AddToResidual(stack="encoder", layer=5, vector=torch.zeros(32))])
    with pytest.raises(ValueError, match="vector is required"):
        model(x, interventions=[AddToDecoderInput()])
