"""Coupling: how the decoder uses the concepts (extension point ``concept.coupling``).

``AddCoupling`` (ConceptLM, NCP-ArchPreview) adds the predicted concept to the decoder input,
causally shifted by the segmentation: z[t] = h[t] + pred[closed(t) - 1] (zeros before the
first closed segment), or ``norm(h) + norm(pred)`` with ``add: normed`` (the GPT-2 variant).

A coupling that cross-attends to the closed concepts instead (DLCM) gives every decoder block
a sub-layer of its own (``decoder_layer``: the block runs it, pre-normed, between attention and
MLP, and adds its output to the update) and hands that sub-layer the concepts through the
decoder's ``Context.memory`` (B, M, d_mem) and ``memory_mask`` (B, 1, T, M), True = visible,
which it builds from ``closed`` (B, T): token t may see concepts 0 .. closed[t] - 1 only
(ncp-model.md section 8). tests/model/toys.py::CrossAttendCoupling is a working example.

Interface (shapes: B batch, T tokens, M concepts, d width):
* ``decoder_layer(cfg, i)`` (classmethod) -> a module for decoder block i, or None;
* ``forward(h, pred, seg, segmenter)`` -> z (B, T, d), the decoder input of a full sequence
  (``segmenter.closed_counts(seg, T)`` gives closed (B, T));
* ``decoder_context(ctx, pred, seg, segmenter)`` -> the decoder's Context (unchanged for addition);
* decoding: ``decode_state(pred, seg, segmenter, like)`` after the prefill (aligned layout:
  index = position; ``seg.n_closed`` (B,) closed concepts per prompt); ``decode_update(state,
  closing, pred)`` when rows may have closed a segment (``closing``: the segmenter's ``Closing``,
  pred (B, d) of the concept at ``closing.index``); ``decode_input(h, state)`` -> z (B, 1, d) of
  the new token; ``decode_context(ctx, state, positions)`` -> the decoder's Context, for the
  prefill (positions (B, Tp) of the slots) or a step (positions (B, 1), after the update).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import make_norm


class Coupling(nn.Module):
    owns_init = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def decoder_layer(cls, cfg: ModelConfig, i: int) -> nn.Module | None:
        return None

    def decoder_context(self, ctx, pred, seg, segmenter):
        return ctx

    def decode_context(self, ctx, state: dict, positions):
        return ctx


class AddCoupling(Coupling):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.normed = cfg.concept.add == "normed"
        self.detach = cfg.concept.detach_added_concept
        if self.normed:  # GPT-2 variant: norm(h) + norm(pred)
            self.norm_h = make_norm(cfg, cfg.d_model)
            self.norm_pred = make_norm(cfg, cfg.d_model)

    def added_term(self, pred: torch.Tensor) -> torch.Tensor:
        """What is added per concept (normed once per concept, so the zero-shifted slots stay 0)."""
        return self.norm_pred(pred) if self.normed else pred

    def combine(self, h: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
        """Decoder input z = h + added (or norm(h) + norm(pred)), both (B, T, d)."""
        if self.detach:
            added = added.detach()
        return (self.norm_h(h) if self.normed else h) + added

    def forward(self, h, pred, seg, segmenter) -> torch.Tensor:
        if pred is None:  # no concept yet (T shorter than one segment): nothing added
            return self.combine(h, torch.zeros_like(h))
        return self.combine(h, segmenter.spread(seg, self.added_term(pred), h.shape[1]))

    # ---- incremental decoding: the added term of each row's latest closed concept ----

    def decode_state(self, pred: torch.Tensor | None, seg, segmenter, like: torch.Tensor) -> dict:
        B, d = like.shape[0], like.shape[-1]
        n_closed = seg.n_closed
        if pred is None:
            return {"pred": like.new_zeros(B, d)}
        last = self.added_term(pred)[torch.arange(B, device=pred.device), (n_closed - 1).clamp_min(0)]  # (B, d)
        return {"pred": torch.where((n_closed > 0)[:, None], last, torch.zeros_like(last))}

    def decode_update(self, state: dict, closing, pred: torch.Tensor) -> None:
        state["pred"] = torch.where(closing.closed[:, None], self.added_term(pred), state["pred"])

    def decode_input(self, h: torch.Tensor, state: dict) -> torch.Tensor:
        return self.combine(h, state["pred"][:, None])
