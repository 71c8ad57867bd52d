"""Coupling: how the decoder uses the concepts (extension point ``concept.coupling``).

``AddCoupling`` (ConceptLM, NCP-ArchPreview) adds the predicted concept to the decoder input,
causally shifted by the segmentation: z[t] = h[t] + pred[closed(t) - 1] (zeros before the
first closed segment), or ``norm(h) + norm(pred)`` with ``add: normed`` (the GPT-2 variant).
A coupling that cross-attends to the closed concepts instead (DLCM) returns h and sets the
decoder's ``Context.memory`` / ``memory_mask`` (``decoder_context``); its decoder blocks then
read the memory.

Interface (shapes: B batch, T tokens, M concepts, d width):
* ``forward(h, pred, seg, segmenter)`` -> z (B, T, d), the decoder input of a full sequence;
* ``decoder_context(ctx, pred, seg)`` -> the decoder's Context (unchanged for addition);
* decoding: ``decode_state(pred, n_closed)`` after a prefill, ``decode_update(state, closed,
  pred)`` when rows close a segment, ``decode_input(h, state)`` -> z (B, 1, d) of the new token.
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

    def decoder_context(self, ctx, pred, seg):
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

    def decode_state(self, pred: torch.Tensor | None, n_closed: torch.Tensor, like: torch.Tensor) -> dict:
        B, d = like.shape[0], like.shape[-1]
        if pred is None:
            return {"pred": like.new_zeros(B, d)}
        last = self.added_term(pred)[torch.arange(B, device=pred.device), (n_closed - 1).clamp_min(0)]  # (B, d)
        return {"pred": torch.where((n_closed > 0)[:, None], last, torch.zeros_like(last))}

    def decode_update(self, state: dict, closed: torch.Tensor, pred: torch.Tensor) -> None:
        state["pred"] = torch.where(closed[:, None], self.added_term(pred), state["pred"])

    def decode_input(self, h: torch.Tensor, state: dict) -> torch.Tensor:
        return self.combine(h, state["pred"][:, None])
