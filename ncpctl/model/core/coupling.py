"""Coupling: how the decoder uses the concepts (extension point ``concept.coupling``).

``AddCoupling`` (ConceptLM, NCP-ArchPreview) adds the predicted concept to the decoder input,
causally shifted by the segmentation: z[t] = h[t] + pred[closed(t) - 1] (zeros before the
first closed segment), or ``norm(h) + norm(pred)`` with ``add: normed`` (the GPT-2 variant).

A coupling that cross-attends to the closed concepts instead (DLCM) gives every decoder block
a sub-layer of its own (``decoder_layer``: the block runs it, pre-normed, between attention and
MLP, and adds its output to the update) and hands that sub-layer the concepts through the
decoder's ``Context.memory`` (B, M, d_mem) and ``memory_mask`` (B, 1, T, M), True = visible,
which it builds from ``closed`` (B, T): token t may see concepts 0 .. closed[t] - 1 only
(ncp-model.md section 8): DLCM's ``CrossAttentionCoupling`` (designs/cross_attention/module.py);
tests/model/toys.py::CrossAttendCoupling is a working example.

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
  ``static_decode``: those three make no host sync and keep their state's shapes once the state
  holds ``closing.length`` concepts (the static decode step, decode_static.py, replays them as a
  CUDA graph; a coupling that does not say so decodes eagerly).
"""

from __future__ import annotations

import torch
from torch import nn

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.layers import make_norm


class Coupling(nn.Module):
    owns_init = False
    static_decode = False  # see the module docstring

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def decoder_layer(cls, cfg: ModelConfig, i: int) -> nn.Module | None:
        return None

    def decoder_context(self, ctx, pred, seg, segmenter):
        return ctx

    def bind(self, model: nn.Module) -> None:
        """Called once the model is built (``NCPModel.__init__``): a coupling that uses one of the
        model's own modules (``add: final_norm``: the final norm) keeps it here."""

    @classmethod
    def document_refusal(cls, cfg: ModelConfig) -> str | None:
        """Why this coupling cannot keep packed documents apart (``data.document_mask``), or None."""
        return None

    def decode_context(self, ctx, state: dict, positions):
        return ctx


class AddCoupling(Coupling):
    """``add: raw``: z = h + spread(pred); ``normed``: norm_h(h) + spread(norm_pred(pred)), norms of
    its own, the zero slots left 0; ``final_norm``: f(h) + f(spread(pred)) with the model's final
    norm f (``bind``), the zero slots normed too (they become f's bias: the authors' GPT-2 code,
    ``ln_f(enc) + ln_f(concept)``)."""

    static_decode = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.normed = cfg.concept.add != "raw"
        self.shared = cfg.concept.add == "final_norm"  # the final norm, bound by the model: no weights here
        self.detach = cfg.concept.detach_added_concept
        if self.normed and not self.shared:  # GPT-2 variant: norm(h) + norm(pred)
            self.norm_h = make_norm(cfg, cfg.d_model)
            self.norm_pred = make_norm(cfg, cfg.d_model)
        self._final: tuple = ()

    def bind(self, model: nn.Module) -> None:
        if self.shared:  # a tuple: the final norm stays the model's module (one set of weights, one key)
            self._final = (model.final_norm,)

    def added_term(self, pred: torch.Tensor) -> torch.Tensor:
        """What is added per concept (normed once per concept, so the zero-shifted slots stay 0)."""
        return self.norm_pred(pred) if self.normed and not self.shared else pred

    def combine(self, h: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
        """Decoder input z = h + added (or norm(h) + norm(pred)), both (B, T, d); with the shared
        final norm, ``added`` is the per-token term before it (zeros where no concept closed)."""
        if self.shared:
            h, added = self._final[0](h), self._final[0](added)
        elif self.normed:
            h = self.norm_h(h)
        return h + (added.detach() if self.detach else added)

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
