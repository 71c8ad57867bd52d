"""Shared helpers for the model tests: tiny configs, random weights, HF construction."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.model import NCPModel

torch.set_num_threads(1)


def tiny(backbone: str = "neox", concept: dict | None = None, **kw) -> ModelConfig:
    """A 2-4 layer, d=32 config that runs in milliseconds."""
    base = dict(
        backbone=backbone, vocab_size=200, pad_vocab_multiple=64, d_model=32, n_layers=3, n_heads=4,
        max_seq_len=64, ffn_dim=48 if backbone == "llama" else None,
    )
    if backbone == "llama":
        base.update(n_kv_heads=2, rope_base=500000.0, norm_eps=1e-6)
    base.update(kw)
    if concept is not None:
        defaults = dict(enabled=True, k=4, encoder_layers=1, concept_layers=2, segments=4, codes=8)
        base["concept"] = {**defaults, **concept}
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0, scale: float = 0.1) -> NCPModel:
    """NCPModel with large random weights (norm gains/biases perturbed too), so that a
    wrong mapping or a causality leak shows up well above fp32 noise."""
    torch.manual_seed(seed)
    model = NCPModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "codebook.base" in name:
                continue
            p.add_(torch.randn_like(p) * scale)
    return model


def hf_model(cls, hf_cfg):
    """HF model from a config with eager attention/experts: an independent reference."""
    hf_cfg._attn_implementation = "eager"
    if hasattr(hf_cfg, "_experts_implementation"):
        hf_cfg._experts_implementation = "eager"
    return cls(hf_cfg).eval()


def tokens(cfg: ModelConfig, B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def check_causal(model: NCPModel, T: int = 13, seed: int = 0) -> None:
    """No position's logits change when later tokens change; the changed next token shows."""
    cfg = model.cfg
    x = tokens(cfg, 1, T)
    ref = model(x).logits
    g = torch.Generator().manual_seed(seed)
    for p in range(T - 1):
        y = x.clone()
        y[:, p + 1 :] = torch.randint(0, cfg.vocab_size, (1, T - p - 1), generator=g)
        y[:, p + 1] = (x[:, p + 1] + 1) % cfg.vocab_size  # surely changed
        got = model(y).logits
        assert torch.allclose(got[:, : p + 1], ref[:, : p + 1], atol=1e-6, rtol=0), p
        assert not torch.allclose(got[:, p + 1], ref[:, p + 1], atol=1e-3)  # the change is visible


def ragged_batch(cfg: ModelConfig, lengths: list[int], n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of lengths[b] + n_new tokens (seqs (B, max + n_new): row b is seqs[b, :lengths[b] +
    n_new]) and their prompts left-padded to max(lengths) slots (B, max)."""
    B, Tp = len(lengths), max(lengths)
    seqs = tokens(cfg, B, Tp + n_new)
    prompt = torch.zeros(B, Tp, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompt[b, Tp - n :] = seqs[b, :n]
    return seqs, prompt


def check_cached_decode(model, seqs: torch.Tensor, prompt: torch.Tensor, lengths: list[int], full: list[torch.Tensor],
                        tol: float, **prefill_kw):
    """``model.prefill`` of the left-padded ``prompt`` and one ``decode_step`` per new token give,
    for every row b, the full forward's logits ``full[b]`` ((lengths[b] + n_new, V)) to ``tol``.
    ``prefill_kw`` go to prefill (max_len, interventions). Returns the decode state."""
    Tp, n_new = prompt.shape[1], full[0].shape[0] - lengths[0]
    with torch.no_grad():
        logits, state = model.prefill(prompt, lengths, **prefill_kw)
        for b, n in enumerate(lengths):
            assert (logits[b, Tp - n :] - full[b][:n]).abs().max() <= tol
        for t in range(n_new):
            step = model.decode_step(state, torch.stack([seqs[b, n + t] for b, n in enumerate(lengths)]))
            for b, n in enumerate(lengths):
                assert (step[b] - full[b][n + t]).abs().max() <= tol, (t, b)
    return state
