"""Toy designs built only through ncpctl's public extension points (``ncpctl.model``): no
model file knows them. The generic design tests run them next to the shipped designs.

* ``Alternating23``: segments of 2, 3, 2, 3, ... tokens, each closing at its last token (a
  variable-length but data-independent segmentation, like fixed blocks);
* ``PerTokenNext``: one concept per token, closing at the *next* token (the law of
  data-dependent segmentations such as DLCM's: a segment is known to be over only when the
  next one starts); its decoding step does not tell the host whether a row closed;
* ``DenseMix``: a DenseFormer / IRC-like depth mixer: layer l's next input is a per-token
  weighted sum of the stack input and every layer output so far, weights = a constant one-hot
  on the newest state + a zero-initialised linear map of the update, so at init it is exactly
  the plain residual network (if ``init_weights`` leaves it alone);
* ``CrossAttendCoupling``: the decoder cross-attends from each token to the concepts closed at
  or before it (softmax over them, each counted once; zero while none is closed) instead of
  adding the prediction: a sub-layer in every decoder block, fed through ``Context.memory``;
* ``CountingSegmenter``: fixed blocks that also report per-step global statistics (token and
  concept counts and a sum of pooled values) through the per-step hook.

Also importable by path (``tests.model.toys:Alternating23``) for recipes run by the real CLI.
"""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from ncpctl.model import (
    Closing, Coupling, FixedBlocks, Residual, SegmentationLaw, Segmenter, Segments, register, segment_means,
)


def _alt_concepts(c, T: int) -> int:
    return 2 * (T // 5) + (1 if T % 5 >= 2 else 0)  # complete segments in T tokens


class _SegmentMeansCost:
    """What the model's cost count asks of a segmentation (``cost``): its pooling is one
    ``segment_means`` GEMM, (M, T) indicator x (T, d), whose backward is h's gradient alone."""

    @staticmethod
    def flops(cfg, T: int, M: int) -> dict[str, int]:
        return {"concept.pooling": 2 * M * T * cfg.d_model}

    @staticmethod
    def backward(cfg, T, M, fwd, grads_in, trains):
        return {"concept.pooling": fwd["concept.pooling"] * grads_in}


class Alternating23(Segmenter):
    law = SegmentationLaw(concepts=_alt_concepts, tokens_per_concept=lambda c: 2.5)
    cost = _SegmentMeansCost

    @staticmethod
    def _layout(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment index and 'last token of its segment' of integer positions."""
        r = pos % 5
        return 2 * (pos // 5) + (r >= 2).long(), (r == 1) | (r == 4)

    def forward(self, h: torch.Tensor) -> Segments:
        B, T, d = h.shape
        pos = torch.arange(T, device=h.device)
        seg_id, last = self._layout(pos)
        M = _alt_concepts(None, T)
        seg_id = torch.where(seg_id < M, seg_id, -1)  # the trailing open segment is not pooled
        c, _ = segment_means(h, seg_id[None].expand(B, T), M)
        closed = torch.cumsum(last.long(), 0)[None].expand(B, T)  # segments closed at or before t
        return Segments(c, torch.arange(M, device=h.device)[None], closed=closed)

    def decode_init(self, B, d, device, dtype):
        return {"sum": torch.zeros(B, d, device=device, dtype=dtype),
                "count": torch.zeros(B, 1, device=device, dtype=dtype)}

    def decode_prefill(self, state, h, lengths, lengths_host):
        B, T, _ = h.shape
        seg = self.forward(h)
        pos = torch.arange(T, device=h.device)
        seg.n_closed = seg.closed[torch.arange(B, device=h.device), lengths - 1]
        seg_id, _ = self._layout(pos)
        open_ = (seg_id[None] == seg.n_closed[:, None]) & (pos[None] < lengths[:, None])  # (B, T)
        state["sum"] = (h * open_[..., None]).sum(1)
        state["count"] = open_.sum(1, keepdim=True).to(h.dtype)
        return seg

    def decode_step(self, state, h, pos, pos_host):
        state["sum"] = state["sum"] + h
        state["count"] = state["count"] + 1
        index, last = self._layout(pos)
        c = state["sum"] / state["count"]
        state["sum"] = state["sum"].masked_fill(last[:, None], 0.0)
        state["count"] = state["count"].masked_fill(last[:, None], 0.0)
        length = max(2 * (p // 5) + (p % 5 >= 2) for p in pos_host) + 1  # host ints: no device sync
        return Closing(last, c, index, index, length, any(p % 5 in (1, 4) for p in pos_host))


class PerTokenNext(Segmenter):
    law = SegmentationLaw(concepts=lambda c, T: T, tokens_per_concept=lambda c: 1.0)

    def forward(self, h: torch.Tensor) -> Segments:
        B, T, _ = h.shape
        ar = torch.arange(T, device=h.device)
        return Segments(h, ar[None], closed=ar[None].expand(B, T))  # token t sees concepts 0..t-1

    def decode_init(self, B, d, device, dtype):
        return {"prev": torch.zeros(B, d, device=device, dtype=dtype)}

    def decode_prefill(self, state, h, lengths, lengths_host):
        seg = self.forward(h)
        seg.n_closed = lengths - 1  # the last prompt token's concept closes with the next token
        state["prev"] = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return seg

    def decode_step(self, state, h, pos, pos_host):
        closed = pos >= 1  # the previous token's segment ends because this one starts
        c, state["prev"] = state["prev"], h
        index = (pos - 1).clamp_min(0)
        return Closing(closed, c, index, index, max(pos_host), None)  # None: the host is not told


class _DenseMixCost:
    """Per stack of n layers on P positions: layer i's Linear(d, i + 2) (a GEMM) and the weighted
    sum of its i + 2 states (elementwise: ``vector``)."""

    key = "residual.dense"

    @staticmethod
    def flops(cfg, stack, shape) -> int:
        n, P = shape[stack]
        return sum(2 * P * cfg.d_model * (i + 2) + 2 * P * (i + 2) * cfg.d_model for i in range(n))

    @staticmethod
    def vector(cfg, stack, shape) -> int:
        n, P = shape[stack]
        return sum(2 * P * (i + 2) * cfg.d_model for i in range(n))


class DenseMix(Residual):
    owns_init = True
    cost = _DenseMixCost

    def __init__(self, cfg, n_layers: int):
        super().__init__(cfg, n_layers)
        self.dyn = nn.ModuleList(nn.Linear(cfg.d_model, layer + 2) for layer in range(n_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in self.dyn:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def begin(self, x0):
        return [x0]

    def forward(self, layer, x, update, hist):
        hist.append(x + update)  # the plain output of this layer
        w = self.dyn[layer](update)  # (B, T, layer + 2) per-token weights, zero at init
        w = w + torch.nn.functional.one_hot(torch.tensor(layer + 1), layer + 2).to(w)  # + the newest state
        out = w[..., :1] * hist[0]
        for j in range(1, layer + 2):
            out = out + w[..., j : j + 1] * hist[j]
        return out


class ConceptCrossAttention(nn.Module):
    """Token -> concept attention over ``ctx.memory`` (B, M, d) where ``ctx.memory_mask``
    (B, 1, T, M) allows; a token that sees no concept gets exactly zero (not a NaN row)."""

    def __init__(self, cfg):
        super().__init__()
        d, self.h = cfg.d_model, cfg.n_heads
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, ctx):
        if ctx.memory is None or ctx.memory.shape[1] == 0:
            return torch.zeros_like(x)
        B, T, d = x.shape
        M, H = ctx.memory.shape[1], self.h
        q = self.q(x).view(B, T, H, d // H).transpose(1, 2)  # (B, H, T, hd)
        k, v = (t.transpose(1, 2) for t in self.kv(ctx.memory).view(B, M, 2, H, d // H).unbind(2))  # (B, H, M, hd)
        seen = ctx.memory_mask.any(-1, keepdim=True)  # (B, 1, T, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.memory_mask | ~seen) * seen
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class _CrossAttendCost:
    """Per decoder block: q and proj on the T tokens, kv on the M concepts, the (T, M) scores and
    weighted sum (SDPA computes the masked entries too)."""

    @staticmethod
    def flops(cfg, T: int, M: int) -> dict[str, int]:
        d = cfg.d_model
        return {"concept.cross_attend": cfg.decoder_layers * (2 * 2 * T * d * d + 2 * M * d * 2 * d + 2 * 2 * T * M * d)}


class CrossAttendCoupling(Coupling):
    cost = _CrossAttendCost
    @classmethod
    def decoder_layer(cls, cfg, i):
        return ConceptCrossAttention(cfg)

    def forward(self, h, pred, seg, segmenter):
        return h  # nothing added: the decoder blocks attend to the concepts

    @staticmethod
    def _visible(closed, M):  # closed (B, T) -> (B, 1, T, M): concept j visible iff j < closed
        return (torch.arange(M, device=closed.device) < closed[..., None])[:, None]

    def decoder_context(self, ctx, pred, seg, segmenter):
        if pred is None:
            return ctx
        closed = segmenter.closed_counts(seg, ctx.cos.shape[2])
        return ctx.with_(memory=pred, memory_mask=self._visible(closed, pred.shape[1]))

    def decode_state(self, pred, seg, segmenter, like):
        B, T, d = like.shape
        memory = like.new_zeros(B, 0, d) if pred is None else pred.clone()
        return {"memory": memory, "n": seg.n_closed.clone(), "closed": segmenter.closed_counts(seg, T)}

    def decode_context(self, ctx, state, positions):
        # the prefill's slots see what their position saw; a step sees every concept closed so far
        closed = state.pop("closed").gather(1, positions) if "closed" in state else state["n"][:, None]
        if state["memory"].shape[1] == 0:
            return ctx
        return ctx.with_(memory=state["memory"], memory_mask=self._visible(closed, state["memory"].shape[1]))

    def decode_update(self, state, closing, pred):
        mem = state["memory"]
        if closing.length > mem.shape[1]:  # room for the concept at index < length
            mem = torch.cat([mem, mem.new_zeros(mem.shape[0], closing.length - mem.shape[1], mem.shape[2])], 1)
        rows = torch.arange(mem.shape[0], device=mem.device)
        mem[rows, closing.index] = torch.where(closing.closed[:, None], pred, mem[rows, closing.index])
        state["memory"] = mem
        state["n"] = torch.where(closing.closed, closing.index + 1, state["n"])

    def decode_input(self, h, state):
        return h


class CountingSegmenter(FixedBlocks):
    """Fixed blocks whose forward also reports local sums for the per-step hook; the hook
    keeps the last global totals it was given."""

    def stat_keys(self):
        return ["toy_tokens", "toy_concepts", "toy_c0_sum"]

    def forward(self, h):
        seg = super().forward(h)
        B, T, _ = h.shape
        seg.stats = {"toy_tokens": h.new_tensor(float(B * T)),
                     "toy_concepts": h.new_tensor(float(seg.concepts.shape[0] * seg.concepts.shape[1])),
                     "toy_c0_sum": seg.concepts[..., 0].detach().sum()}
        return seg

    def on_step_end(self, stats):
        """Keeps the totals; with $NCP_TOY_STATS set, also appends them to $NCP_TOY_STATS.<rank>
        (so a test of the real CLI sees what every rank's hook received)."""
        import json
        import os

        self.last_totals = dict(stats)
        if os.environ.get("NCP_TOY_STATS"):
            with open(f"{os.environ['NCP_TOY_STATS']}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps(self.last_totals) + "\n")


register("segmentation", "alt23", Alternating23)
register("segmentation", "per_token_next", PerTokenNext)
register("segmentation", "counting", CountingSegmenter)
register("residual", "dense", DenseMix)
register("coupling", "cross_attend", CrossAttendCoupling)
