"""Incremental decoding (spec section 5) equals the full forward at every position,
for a ragged (left-padded) batch whose rows complete concept blocks at different steps."""

from __future__ import annotations

import pytest
import torch

from ._helpers import build, check_cached_decode, ragged_batch, tiny, tokens

CONFIGS = {
    "neox-base": tiny("neox"),
    "llama-base-swa": tiny("llama", qk_norm="head", sliding_window=3, full_attn_every=2),
    "neox-conceptlm-k4": tiny("neox", concept=dict(k=4)),
    # windows bind in both the token and the concept stacks (M up to 5 > 2)
    "llama-archpreview-like": tiny(
        "llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
        concept=dict(k=4, code_weights="softmax", ncp_reduction="sum_dim", rope_scale_by_k=True, concept_layers=3),
    ),
    "neox-k3-e0-normed": tiny("neox", concept=dict(k=3, encoder_layers=0, add="normed", concept_layers=1)),
    "llama-k2-e2": tiny("llama", concept=dict(k=2, encoder_layers=2, codebook="learned")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_equals_full_forward(name):
    cfg = CONFIGS[name]
    model = build(cfg, scale=0.2)
    lengths = [5, 2, 7, 4]  # prompt lengths; rows are left-padded to 7 slots
    n_new = 13
    Tp = max(lengths)
    seqs, prompt = ragged_batch(cfg, lengths, n_new)  # row b: seqs[b, :lengths[b] + n_new]
    with torch.no_grad():
        full = [model(seqs[b : b + 1, : n + n_new]).logits[0] for b, n in enumerate(lengths)]  # (n+n_new, V)
    state = check_cached_decode(model, seqs, prompt, lengths, full, 1e-5, max_len=Tp + n_new)
    assert state.lengths == [n + n_new for n in lengths]
    with pytest.raises(ValueError, match="full"):
        model.decode_step(state, seqs[:, 0])


def test_prompts_shorter_than_a_block():
    model = build(tiny("neox", concept=dict(k=4)))
    seqs = tokens(model.cfg, 2, 9)
    with torch.no_grad():
        _, state = model.prefill(seqs[:, :2], [2, 1], max_len=9)
        assert torch.all(state.pred == 0)
        full = model(seqs[:1, :9]).logits[0]
        for t in range(2, 9):
            step = model.decode_step(state, seqs[:, t])
        assert (step[0] - full[8]).abs().max() <= 1e-5


def test_cached_calls_on_a_gpu_avoid_cudnn_attention(monkeypatch):
    """A cached call's key length changes every step, and cuDNN's fused attention re-plans per
    shape (75 ms per token at pythia-160m on an H200): cached calls on a GPU run under
    ``sdpa_kernel`` without cuDNN, uncached ones keep PyTorch's choice. The GPU is faked here by
    forcing the cached rule on the CPU: decoding still equals the full forward, and every cached
    attention call (prefill and steps) went through the restricted backends."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend

    from ncpctl.model.core import layers
    assert SDPBackend.CUDNN_ATTENTION not in layers.CACHED_BACKENDS
    gpu = SimpleNamespace(is_cuda=True)
    assert layers.cached_backends(gpu, True) == layers.CACHED_BACKENDS
    assert layers.cached_backends(gpu, False) is None
    assert layers.cached_backends(torch.zeros(1), True) is None  # the CPU: PyTorch's own choice
    entered = []
    real = layers.sdpa_kernel

    def counting(backends):
        entered.append(list(backends))
        return real(backends)

    monkeypatch.setattr(layers, "cached_backends", lambda q, cached: layers.CACHED_BACKENDS if cached else None)
    monkeypatch.setattr(layers, "sdpa_kernel", counting)
    cfg = tiny("neox", concept=dict(k=4))
    model = build(cfg, scale=0.2)
    seqs = tokens(cfg, 1, 9)
    with torch.no_grad():
        full = model(seqs).logits[0]  # uncached: no restriction
        assert entered == []
        _, state = model.prefill(seqs[:, :3], [3], max_len=9)
        for t in range(3, 9):
            step = model.decode_step(state, seqs[:, t])
    assert (step[0] - full[8]).abs().max() <= 1e-5
    assert len(entered) >= 7 * cfg.n_layers and all(b == layers.CACHED_BACKENDS for b in entered)


MULTI = {**CONFIGS, "dlcm": tiny("llama", concept={"segmentation": "dynamic", "ncp_weight": 0.0, "vq_weight": 0.0}),
         "dlcm-cross-attention": tiny("llama", concept={"segmentation": "dynamic", "ncp_weight": 0.0, "vq_weight": 0.0,
                                                        "coupling": "cross_attention"})}


@pytest.mark.parametrize("name", list(MULTI))
def test_multi_token_step_equals_full_forward(name):
    """``decode.step_many`` (speculative decoding's verification: several tokens per row in one
    cached forward, concept blocks and DLCM boundaries closing inside the chunk) gives the full
    forward's logits at every position, for a ragged batch."""
    from ncpctl.model.core.decode import step_many

    cfg = MULTI[name]
    model = build(cfg, scale=0.2)
    lengths, n_new = [5, 2, 7, 4], 13
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    with torch.no_grad():
        full = [model(seqs[b : b + 1, : n + n_new]).logits[0] for b, n in enumerate(lengths)]
        _, state = model.prefill(prompt, lengths, max_len=max(lengths) + n_new)
        t = 0
        for size in (3, 1, 5, 4):  # chunks of the 13 new tokens
            new = torch.stack([seqs[b, n + t : n + t + size] for b, n in enumerate(lengths)])  # (B, size)
            got = step_many(model, state, new)  # (B, size, V)
            for b, n in enumerate(lengths):
                assert (got[b] - full[b][n + t : n + t + size]).abs().max() <= 1e-5, (t, b)
            t += size
