"""Incremental decoding in the exported ConceptLM remote code (spec section 5): HF `generate`
with the cache picks the tokens of the full recompute (`use_cache=False`), its logits at every
step are the full forward's, left-padded batches included, and each step runs one position."""

from __future__ import annotations

import pytest
import torch
import transformers

from ncpctl.checkpoint import save_model_files
from ncpctl.interop.hf_export import export
from ncpctl.model.core.config import build_config

from ..model._helpers import build

torch.set_num_threads(1)

N_NEW = 20
# Random-weight ConceptLMs covering both block sizes and the concept-path variants that change
# what the cache must hold: windowed token and concept layers (window 8 < prompt + new tokens,
# and < the 15 blocks of k=2), normed add, RoPE scaled by k, E=0 (blocks of embeddings).
VARIANTS = {
    "neox-k4": ("debug", dict(concept=dict(enabled=True, k=4))),
    "llama-k2-window": ("llama-debug", dict(sliding_window=8, concept=dict(
        enabled=True, k=2, add="normed", rope_scale_by_k=True))),
    "neox-k2-e0": ("debug", dict(tie_embeddings=True, concept=dict(
        enabled=True, k=2, encoder_layers=0, codebook="learned", code_weights="softmax"))),
    # NCP-ArchPreview's dynamic residuals (IRC in every stack, all three CRC connections) and an
    # MTP head, which the export leaves out (training only)
    "llama-irc-crc-mtp": ("llama-debug", dict(residual="irc", crc_connections=[
        "encoder-concept", "encoder-decoder", "concept-decoder"], mtp_depth=1, concept=dict(enabled=True, k=4))),
    # Table 3's other arms: IRC + the input-level cross connection; Block AttnRes with cross-module
    # block states (blocks of 2 over the 1 encoder and 3 decoder layers: open and complete blocks)
    "llama-irc-input": ("llama-debug", dict(residual="irc", crc_mode="input", crc_connections=[
        "encoder-concept", "encoder-decoder", "concept-decoder"], concept=dict(enabled=True, k=4))),
    "llama-block-attnres-k2": ("llama-debug", dict(residual="block_attnres", attnres_block=2,
                                                   concept=dict(enabled=True, k=2))),
    # GPT-2: learned absolute positions per row (left padding), concepts pooled from block 0's input
    "gpt2-k4-l0": ("gpt2-124m", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128, concept=dict(
        enabled=True, k=4))),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_model(request, runs, tmp_path_factory):
    size, over = VARIANTS[request.param]
    model = build(build_config(size, vocab_size=1024, **over), seed=3)
    root = tmp_path_factory.mktemp(request.param)
    save_model_files(root / "ck", model, step=0, tokens_seen=0, recipe=None,
                     tokenizer_path=runs["concept"] / "tokenizer.json")
    export(root / "ck", root / "hf")
    m = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True,
                                                          dtype=torch.float32).eval()
    return m, model.cfg.concept.k


def _prompts():
    """Two left-padded prompts of 11 and 7 tokens (no multiple of k = 2 or 4): (2, 11) ids, mask."""
    x = torch.randint(1, 1024, (2, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    x[1, :4], mask[1, :4] = 0, 0
    return x, mask


def _generate(m, x, mask, **kw):
    # eos_token_id=None: every row runs all N_NEW steps (the mask is explicit, so none is inferred)
    return m.generate(x, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=None, **kw)


def test_cached_generate_matches_full_recompute(hf_model):
    m, _ = hf_model
    x, mask = _prompts()
    for xs, ms in ((x, mask), (x[:1, 2:], mask[:1, 2:])):  # padded batch; one unpadded 9-token prompt
        cached = _generate(m, xs, ms, do_sample=False, return_dict_in_generate=True)
        assert type(cached.cache).__name__ == "NCPCache"
        full = _generate(m, xs, ms, do_sample=False, use_cache=False)
        assert cached.sequences.shape == (xs.shape[0], xs.shape[1] + N_NEW)
        assert torch.equal(cached.sequences, full)
    torch.manual_seed(0)
    sampled = _generate(m, x, mask, do_sample=True, top_k=0)
    torch.manual_seed(0)
    assert torch.equal(sampled, _generate(m, x, mask, do_sample=True, top_k=0, use_cache=False))
    beams = dict(num_beams=3, do_sample=False)  # the cache is reordered after every step
    assert torch.equal(_generate(m, x, mask, **beams), _generate(m, x, mask, use_cache=False, **beams))


@pytest.mark.parametrize("use_cache", [True, False])
def test_step_logits_equal_each_rows_full_forward(hf_model, use_cache):
    """Step i's logits of row b == the unpadded full forward of row b alone at its position."""
    m, _ = hf_model
    x, mask = _prompts()
    out = _generate(m, x, mask, do_sample=False, use_cache=use_cache, return_dict_in_generate=True,
                    output_logits=True)
    assert len(out.logits) == N_NEW
    for b in range(2):
        pad = int((mask[b] == 0).sum())
        with torch.no_grad():
            ref = m(out.sequences[b : b + 1, pad:]).logits[0]  # (T_b + N_NEW, V)
        start = x.shape[1] - pad - 1  # the prompt's last position predicts the first new token
        got = torch.stack([step[b] for step in out.logits])  # (N_NEW, V)
        assert (got - ref[start : start + N_NEW]).abs().max() <= 1e-5


def test_each_cached_step_runs_one_position(hf_model):
    m, k = hf_model
    x, mask = _prompts()
    seen = {"token": [], "concept": []}
    hooks = [m.decoder[-1].register_forward_hook(lambda mod, args, out: seen["token"].append(args[0].shape[1])),
             m.concept.layers[0].register_forward_hook(lambda mod, args, out: seen["concept"].append(args[0].shape[1]))]
    try:
        _generate(m, x, mask, do_sample=False)
        cached = dict(seen)
        seen.update(token=[], concept=[])
        _generate(m, x, mask, do_sample=False, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    T, pads = x.shape[1], (mask == 0).sum(1).tolist()
    # the prompt once, then the N_NEW - 1 fed-back tokens one at a time
    assert cached["token"] == [T] + [1] * (N_NEW - 1)
    # a concept step only when some row completes a block with the token fed at slot s
    completes = sum(any((s - p) % k == k - 1 for p in pads) for s in range(T, T + N_NEW - 1))
    assert cached["concept"] == [T // k] + [1] * completes
    assert seen["token"] == list(range(T, T + N_NEW))  # use_cache=False: the whole sequence each step


def test_padding_rules(hf_model):
    """Right padding stays legal without a cache (the real positions are unchanged); a cache
    needs left padding; padding inside a row is rejected."""
    m, _ = hf_model
    x, _ = _prompts()
    right = torch.ones_like(x)
    right[1, 7:] = 0
    with torch.no_grad():
        assert torch.equal(m(x, attention_mask=right).logits, m(x).logits)
        with pytest.raises(ValueError, match="pad on the left"):
            m(x, attention_mask=right, use_cache=True)
        inner = torch.ones_like(x)
        inner[0, 3] = 0
        with pytest.raises(ValueError, match="never inside"):
            m(x, attention_mask=inner)
