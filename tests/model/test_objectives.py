"""The objective extension point and declared attention patterns, over the default next-token
objective and two toy objectives added only through the public API (tests/model/toy_objectives.py):
the generic design properties in each objective's own sense (causality, cached decoding equal to
the full forward where the objective decodes on caches, a training step), generation through the
objective's decoding, and the kernel each pattern maps to (SDPA ``is_causal`` with no mask on the
default path, a boolean mask otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model import BlockCausal, Causal, ModelConfig, NextToken
from ncpctl.model.core.layers import attn_mask, causal_masks
from ncpctl.model.core.patterns import kernel_masks
from ncpctl.inference import SamplingParams, generate

from . import toy_objectives as toys
from . import toys as _segmentations  # noqa: F401  (registers the toy segmentation "alt23")
from ._helpers import build, check_cached_decode, check_causal, ragged_batch, tiny, tokens

TWO = tiny("llama", objective="two_ahead", sliding_window=3, full_attn_every=2)
TWO_CONCEPT = tiny("neox", objective="two_ahead", concept=dict(segmentation="alt23"))  # with a toy segmentation
MASKED = tiny("neox", objective="tests.model.toy_objectives:MaskedBlocks")  # by import path


def test_next_token_is_the_default_and_old_configs_read_as_it():
    cfg = tiny("neox")
    assert cfg.objective == "next_token" and isinstance(build(cfg).objective, NextToken)
    old = cfg.to_dict()
    old.pop("objective")  # a checkpoint written before the key existed
    assert ModelConfig.from_dict(old).objective == "next_token"


def test_patterns_map_to_the_fastest_kernel():
    T = 9
    pos = torch.arange(T)[None]
    masks = kernel_masks({Causal(None), Causal(16), Causal(3), BlockCausal(4)}, T, torch.device("cpu"))
    assert masks[None] is None and masks[16] is None  # SDPA is_causal: no mask built
    assert torch.equal(masks[3], attn_mask(pos, pos, 3))
    assert causal_masks({None, 3}, T, torch.device("cpu")).keys() == {None, 3}  # windows stay the causal keys
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    assert torch.equal(masks[BlockCausal(4)][0, 0], k // 4 <= q // 4)  # own block and earlier ones


def _sdpa_calls(model, x, monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append((attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(x)
    monkeypatch.undo()
    return seen


def test_default_path_is_sdpa_is_causal_and_the_masked_toy_gets_its_block_mask(monkeypatch):
    calls = _sdpa_calls(build(tiny("neox")), tokens(tiny("neox"), 2, 11), monkeypatch)
    assert len(calls) == 3 and all(m is None and c for m, c in calls)
    calls = _sdpa_calls(build(MASKED), tokens(MASKED, 2, 11), monkeypatch)
    want = (torch.arange(11)[None] // 4 <= torch.arange(11)[:, None] // 4)
    assert len(calls) == 3 and all(m is not None and not c and torch.equal(m[0, 0], want) for m, c in calls)


# ---- two tokens ahead: causal, decodes on KV caches ----

@pytest.mark.parametrize("cfg", [TWO, TWO_CONCEPT], ids=["sliding-llama", "alternating-concepts-neox"])
def test_two_ahead_is_causal_and_decodes_exactly_on_caches(cfg):
    model = build(cfg, scale=0.2).double()
    with torch.no_grad():
        check_causal(model, T=13, seed=7)
    lengths, n_new = [5, 2, 7, 4], 6
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    with torch.no_grad():
        full = [model(seqs[b : b + 1, : n + n_new]).logits[0] for b, n in enumerate(lengths)]
    check_cached_decode(model, seqs, prompt, lengths, full, 1e-9)


def test_two_ahead_trains_on_the_token_two_ahead():
    model = build(TWO).train()
    w = tokens(TWO, 2, 17)
    x, y = model.objective.batch(w)
    out = model(x, y)
    keys = [k.name for k in model.log_keys()]
    assert list(out.losses)[0] == "two_ahead_loss" and keys[:2] == ["loss", "two_ahead_loss"]
    with torch.no_grad():
        logits = model(x).logits[:, :-1]  # the padded vocabulary, as the fused head
    ref = F.cross_entropy(logits.flatten(0, 1), w[:, 2:].flatten())
    assert torch.allclose(out.loss, ref, atol=1e-5)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_two_ahead_generates_each_token_from_two_positions_back():
    model = build(TWO, scale=0.3)
    prompts = [[5, 9, 3], [7], [1, 2, 3, 4, 5]]
    outs = generate(model, prompts, SamplingParams(max_new_tokens=5, greedy=True), str, vocab_size=TWO.vocab_size)
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            seq = torch.tensor(p + c.tokens)[None]
            logits = model(seq).logits[0, :, : TWO.vocab_size]
            L = len(p)
            want = [int(logits[max(L + i - 2, 0)].argmax()) for i in range(5)]
            assert c.tokens == want


# ---- masked blocks: block-causal, full forwards ----

def test_masked_blocks_is_causal_across_blocks_and_bidirectional_inside_one():
    model = build(MASKED, scale=0.3).double()
    x = tokens(MASKED, 1, 14)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref = model(x).logits
        for b in range(1, 4):  # change every token of blocks >= b: blocks < b do not see it
            y = x.clone()
            y[:, 4 * b:] = torch.randint(0, MASKED.vocab_size, (1, 14 - 4 * b), generator=g)
            y[:, 4 * b] = (x[:, 4 * b] + 1) % MASKED.vocab_size
            got = model(y).logits
            assert torch.allclose(got[:, : 4 * b], ref[:, : 4 * b], atol=1e-9, rtol=0), b
            assert not torch.allclose(got[:, 4 * b], ref[:, 4 * b], atol=1e-3)
        y = x.clone()
        y[:, 7] = (x[:, 7] + 1) % MASKED.vocab_size  # the last token of block 1 reaches its first
        assert not torch.allclose(model(y).logits[:, 4], ref[:, 4], atol=1e-3)


def test_masked_blocks_trains_on_masked_tokens_and_refuses_cached_decoding():
    model = build(MASKED).train()
    w = tokens(MASKED, 3, 17)
    torch.manual_seed(0)
    x, y = model.objective.batch(w)
    hidden = x == model.objective.mask_id
    assert hidden.any() and torch.equal(y[hidden], w[:, :-1][hidden]) and (y[~hidden] == -100).all()
    out = model(x, y)
    assert list(out.losses)[0] == "masked_loss" and torch.isfinite(out.loss)
    out.loss.backward()
    with pytest.raises(ValueError, match="does not decode on KV caches"):
        model.eval().prefill(x[:1, :4], [4])


def test_masked_blocks_generates_from_the_first_mask_of_the_block():
    model = build(MASKED, scale=0.3)
    prompts = [[5, 9, 3], [7, 1, 2, 3, 4]]
    outs = generate(model, prompts, SamplingParams(max_new_tokens=4, greedy=True), str,
                    vocab_size=MASKED.vocab_size)
    m = model.objective.mask_id
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            seq = list(p)
            for t in c.tokens:
                n = len(seq)
                x = torch.tensor(seq + [m] * (toys.BLOCK - n % toys.BLOCK))[None]
                assert int(model(x).logits[0, n, : MASKED.vocab_size].argmax()) == t
                seq.append(t)
