"""Attention stability diagnostics (ncpctl/model/core/stability.py; NCP-ArchPreview Sec. 4.6): the
max attention logit and max per-head q / k norms equal a direct reference that materialises the
logits with explicitly built masks (causal, sliding window, padding), for GQA and every QK-norm;
they are taken from the very q and k SDPA gets; and computing them changes nothing in training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.core.layers import Attention, attn_mask
from ncpctl.model.core.stability import attention_maxima

from ._helpers import build, tiny, tokens


def _reference(q: torch.Tensor, k: torch.Tensor, window: int | None, k_valid: torch.Tensor | None = None):
    """Float64, the whole (Tq, Tk) logit matrix per head; key heads repeated for GQA; the mask
    built here from the rule (0 <= i - j < window; padding keys hidden except from themselves)."""
    B, H, T, hd = q.shape
    q, k = q.double(), k.double().repeat_interleave(H // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, H, T, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    vis = (i >= j) & ((i - j < window) if window is not None else True)
    vis = vis[None].expand(B, T, T)
    if k_valid is not None:
        vis = vis & (k_valid[:, None, :] | (i == j))
    masked = logits.masked_fill(~vis[:, None], -math.inf).amax()
    return torch.stack([masked, q.norm(dim=-1).amax(), k.norm(dim=-1).amax()]), logits.amax()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("chunk_elements", [1, 1 << 20])  # one query per chunk, or all at once
@pytest.mark.parametrize("padded", [False, True])
def test_maxima_equal_the_materialised_logits(window, n_kv, chunk_elements, padded) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, T, hd = 2, 4, 11, 8
    q, k = torch.randn(B, H, T, hd, generator=g), torch.randn(B, n_kv, T, hd, generator=g)
    k[..., T - 1, :] *= 8  # a large last key, and query 0 aligned with it: the largest logit is
    q[:, :, 0] = k[:, torch.arange(H) // (H // n_kv), T - 1]  # (0, T-1), which no mask shows
    pos = torch.arange(T)[None]
    k_valid = torch.ones(B, T, dtype=torch.bool)
    if padded:
        k_valid[0, :3] = False  # row 0 left-padded: its first 3 keys hidden
        k_valid[1, 5] = False  # and key 5 of row 1 (then visible only to query 5 itself)
    if window is None and not padded:
        mask = None  # SDPA's is_causal
    else:
        mask = attn_mask(pos, pos, window, k_valid if padded else None)  # (B|1, 1, T, T)
    got = attention_maxima(q, k, mask, chunk_elements=chunk_elements)
    want, unmasked = _reference(q, k, window, k_valid if padded else None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert unmasked > want[0] + 1e-3  # the mask matters here: the unmasked max is larger


def test_maxima_of_bf16_inputs_are_computed_in_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 6, 8, generator=g).bfloat16(), torch.randn(1, 2, 6, 8, generator=g).bfloat16()
    got = attention_maxima(q, k, None)
    want, _ = _reference(q.float(), k.float(), None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- on the model

DESIGNS = {
    # neox: partial rotary, no QK-norm; ConceptLM concept path (encoder, concept, decoder stacks)
    "neox-conceptlm": tiny("neox", concept={}),
    # llama, GQA 4/2, sliding window 3 with every 2nd layer full, layer-wise QK-norm (ArchPreview)
    "llama-swa-layer-norm": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
                                 concept=dict(k=3, code_weights="softmax", rope_scale_by_k=True)),
    # per-head QK-norm (Fig. 6's fix), with an MTP depth and IRC + CRC, post-norm
    "llama-swa-head-norm-mtp": tiny("llama", qk_norm="head", sliding_window=3, full_attn_every=2,
                                    norm_placement="post", residual="irc", mtp_depth=1,
                                    crc_connections=["encoder-concept", "encoder-decoder", "concept-decoder"],
                                    concept=dict(k=2, code_weights="softmax")),
    # no QK-norm with RoPE: q and k rotated in one fused pass; GQA 4/1
    "llama-fused-rope-gqa": tiny("llama", n_kv_heads=1, sliding_window=4, full_attn_every=3),
    # gpt2: no rotary at all, base model (no concept path)
    "gpt2-base": tiny("gpt2", tie_embeddings=True),
}


def _sdpa_inputs(model, idx, targets, monkeypatch):
    """Per layer (block path), what SDPA received: q, k, mask, is_causal; from a plain forward
    (eval; the MTP depths run on the hidden states as in training)."""
    seen, current = {}, []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen[current[-1]] = (q.detach().clone(), k.detach().clone(), attn_mask, is_causal)
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name.removesuffix(".attn"): current.append(name))
               for name, m in model.named_modules() if isinstance(m, Attention)]
    with torch.no_grad():
        out = model(idx, return_hidden=True)
        if model.mtp is not None:
            model.mtp(out.hidden, targets, model)
    for h in handles:
        h.remove()
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    return seen


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_model_stats_are_those_of_the_logits_sdpa_computes(name: str, monkeypatch) -> None:
    cfg = DESIGNS[name]
    model = build(cfg, scale=0.3)
    idx = tokens(cfg, 2, 13)
    targets = tokens(cfg, 2, 13, seed=2)
    stats = model.attention_stats(idx, targets, chunk_elements=64)  # several chunks per layer
    seen = _sdpa_inputs(model, idx, targets, monkeypatch)
    windows = {n.removesuffix(".attn"): m.window for n, m in model.named_modules() if isinstance(m, Attention)}
    layers = list(windows)
    assert set(seen) == set(layers)
    expected_keys = ["attn/max_logit", "attn/max_q_norm", "attn/max_k_norm"]
    stage = {"encoder": 0, "concept": 1, "decoder": 2, "mtp": 3}
    for layer in sorted(layers, key=lambda n: stage[n.split(".")[0]]):  # data-flow order
        expected_keys += [f"attn/{layer}/max_logit", f"attn/{layer}/max_q_norm", f"attn/{layer}/max_k_norm"]
    assert list(stats) == expected_keys
    for layer, (q, k, mask, is_causal) in seen.items():
        w = windows[layer]
        assert (mask is None) == is_causal
        want, _ = _reference(q, k, w if w is not None and w < q.shape[2] else None)
        got = torch.stack([stats[f"attn/{layer}/{x}"] for x in ("max_logit", "max_q_norm", "max_k_norm")])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layer}: {m}")
    per_layer = torch.stack([stats[k] for k in expected_keys[3:]]).view(-1, 3)
    torch.testing.assert_close(torch.stack([stats[k] for k in expected_keys[:3]]), per_layer.amax(0))
    if cfg.sliding_window is not None:  # some layer's window hides pairs of this 13-token batch
        assert any(w is not None and w < 13 for w in windows.values())
    if cfg.mtp_depth:
        assert "attn/mtp.depths.0.layer.0/max_logit" in stats
        assert "attn/mtp.depths.0.layer.0/max_logit" not in model.attention_stats(idx)  # MTP needs targets


def test_per_head_qk_norm_bounds_the_norms() -> None:
    """With per-head RMSNorm each head's q (before RoPE, which keeps norms) has norm
    sqrt(hd) * |gain| at most: the reason Fig. 6's per-head arm stays low."""
    cfg = DESIGNS["llama-swa-head-norm-mtp"]
    model = build(cfg, scale=0.3)
    stats = model.attention_stats(tokens(cfg, 2, 13))
    for blk in model.token_layers():
        name = next(n for n, m in model.named_modules() if m is blk)
        for x, norm in (("q", blk.attn.q_norm), ("k", blk.attn.k_norm)):
            bound = math.sqrt(cfg.head_dim) * norm.weight.abs().max().item()
            assert stats[f"attn/{name}/max_{x}_norm"].item() <= bound * (1 + 1e-5)


@pytest.mark.parametrize("name", ["neox-conceptlm", "llama-swa-head-norm-mtp"])
def test_training_is_bit_identical_with_the_stats(name: str) -> None:
    """Three AdamW steps, with the diagnostics before each step or never: the same losses and
    weights bit for bit; the module modes are restored and no probe is left behind."""
    torch.set_num_threads(1)
    cfg = DESIGNS[name]
    runs = []
    for with_stats in (False, True):
        model = build(cfg, seed=3).train()
        if model.concept is not None:
            model.concept.layers.eval()  # a mixed state of modes, to be restored
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            idx, tgt = tokens(cfg, 2, 12, seed=10 + step), tokens(cfg, 2, 12, seed=20 + step)
            if with_stats:
                stats = model.attention_stats(idx, tgt)
                assert all(torch.isfinite(v) for v in stats.values())
            out = model(idx, tgt)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        modes = {n: m.training for n, m in model.named_modules()}
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}, modes))
        assert all("probe" not in m.__dict__ for m in model.modules() if isinstance(m, Attention))
    (l0, w0, m0), (l1, w1, m1) = runs
    assert l0 == l1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert m0 == m1 and m1[""] is True
    if "concept.layers" in m1:
        assert m1["concept.layers"] is False


def test_stats_are_the_same_in_train_and_eval_mode() -> None:
    cfg = DESIGNS["llama-swa-layer-norm"]
    model = build(cfg)
    idx = tokens(cfg, 2, 13)
    a = model.train().attention_stats(idx)
    assert model.training
    b = model.eval().attention_stats(idx)
    assert not model.training
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
