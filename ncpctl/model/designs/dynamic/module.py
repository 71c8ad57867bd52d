"""DLCM's dynamic segmentation (``concept.segmentation: dynamic``; DLCM Sec. 3.3, 8.1).

Boundaries. b_t = 1 means token t *starts* a segment; b_0 = 1. From h (B, T, d), the encoder
output:

* ``boundary_mode: predictor`` (Sec. 3.3.1): q = W_q h, k = W_k h (bias-free, identity at init as
  in H-Net), p_t = (1 - cos(q[t-1], k[t]))/2 for t >= 1, p_0 = 1. Training samples
  b_t ~ Bernoulli(sigmoid(logit(p_t) / temperature)) (temperature < 1 sharpens p away from 0.5;
  p = 0.5 stays 0.5, so training and inference cut at the same p, and temperature -> 0 is the
  inference rule itself: the default 0.1 keeps the inference rate near the trained one);
  inference (eval mode and incremental decoding) takes b_t = [p_t >= threshold]. The sampling
  noise is a counter-based hash of (global sample index, t) (``keyed_uniform``), so a sample draws the same boundaries
  on any rank, at any batch position and under any world size; without sample indices the
  global torch RNG is used (not rank-invariant).
* ``boundary_mode: boundary`` (Sec. 8.1, from h[t-1] and h[t], never h[t+1]): b_t = [(1 - cos(h[t-1],
  h[t]))/2 >= tau], in training and inference alike; no parameters, no balance loss.

Gradients. The boundaries are discrete and the pooling uses h only, so nothing downstream
depends on p differentiably: the LM loss (and the NCP/VQ losses) never reach W_q, W_k. Their
only signal is the balance loss through G. With ``boundary_grad_to_encoder: false`` (default)
the predictor reads h detached, so the balance loss does not reach the encoder either.

Segments. seg(t) = cumsum(b)[t] - 1 is t's segment; segment j = [s, e] is known to be over
only when segment j+1 starts at e+1, so ``closed(t) = seg(t)`` and token t may use concepts
0 .. seg(t) - 1 (ncp-model.md section 8). A row's last segment is still open at T - 1: it is
not pooled (like a trailing partial block). Concepts are segment means of h (B, M, d), M = the
most closed segments of any row (one host sync per forward), rows with fewer marked by
``valid`` and zero-padded after their real ones; RoPE positions of the concept transformer =
the concept index j. The up-projection W_up to ``d_concept`` (Sec. 3.3.2) is the concept path's
(``ConceptModule.lift``), so any segmentation can feed a wider concept transformer.

Load balance (Eq. 10): L_aux = R/(R-1) [(R-1) F G + (1-F)(1-G)] - 1, with F the realised
boundary rate (no gradient) and G the mean of p; dL/dG = R/(R-1) (R F - 1), so p is pushed down
when F > 1/R and up when F < 1/R. Both count every token, t = 0 included (b_0 = p_0 = 1), so
1/F is exactly the realised tokens per concept.

* ``balance: global`` (the Global Parser): L_aux is linear in G, so the mean of the per-micro-batch
  terms L(F, G_mb) over micro-batches and data-parallel ranks (how DeepSpeed combines them,
  every micro-batch having the same token count) is L(F, G_global), and the gradient through G
  is exactly the global batch's. F is the global boundary rate, which is known only after the
  step's last micro-batch: this module uses the *previous* optimizer step's global F (the
  all-reduced totals of ``stat_keys`` handed to ``on_step_end``, kept as the integer buffer
  ``rate_counts``, so a resume continues exactly), so F lags one step and the scheme is exact
  in G, not in F. The first step has no F yet and uses F = 1/R, where L_aux = 0 and has no
  gradient. Every step's loss and gradient are therefore the same for any number of ranks and
  accumulation steps (a test runs 1 and 2 ranks, with and without accumulation). Evaluation
  uses each batch's own F.
* ``balance: sequence`` (Table 4's Normal): the mean over sequences of L(F_b, G_b) with each row's
  own F_b, G_b: exact, no global state.

Decoding keeps per row: the previous token's q (or h in boundary mode) for the boundary test,
the running sum and count of the open segment and the number of closed segments; the new
token's b_t closes the previous segment (its mean is the concept at index ``n``) before the
token itself is decoded.
"""

from __future__ import annotations

import torch
from torch import nn

from ncpctl.model.designs.dynamic.config import DYNAMIC
from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.outputs import LogKey
from ncpctl.model.core.segment import Closing, Segmenter, Segments, document_concepts, segment_means

_M32 = 0xFFFFFFFF
_SALT = 0x9E3779B9  # separates this stream from any other use of the same hash


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for int64 x in [0, 2^32) without int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return ((((hi * m) & 0xFFFF) << 16) + lo * m) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the 'lowbias32' mixer), int64 in and out, values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_uniform(sample_ids: torch.Tensor, T: int) -> torch.Tensor:
    """Uniform [0, 1) noise (B, T) float32 that depends only on (sample_ids[b], t): the same
    draws for a sample on any rank, batch position or device (integer arithmetic only)."""
    sid = sample_ids.to(torch.int64)
    key = _mix32(_mix32((sid & _M32) ^ _SALT) ^ ((sid >> 32) & _M32))  # (B,)
    t = _mix32(torch.arange(T, device=sid.device, dtype=torch.int64) + _SALT)  # (T,)
    x = _mix32((key[:, None] + t[None]) & _M32)  # (B, T)
    return (x >> 8).to(torch.float32) / float(1 << 24)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos of the last dims: a.b / (|a| |b|) (the one formula of the forward and the decode step)."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 or wider (a bf16 cosine near 0.5 would flip boundaries between two paths)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def balance_loss(F_rate: torch.Tensor, G: torch.Tensor, R: float) -> torch.Tensor:
    """DLCM Eq. 10: R/(R-1) [(R-1) F G + (1-F)(1-G)] - 1 (elementwise; F is detached)."""
    F_rate = F_rate.detach()
    return R / (R - 1) * ((R - 1) * F_rate * G + (1 - F_rate) * (1 - G)) - 1


class DynamicSegmenter(Segmenter):
    law = DYNAMIC
    owns_init = True  # W_q = W_k = I is the design, not NCPModel's normal init
    keyed = True  # forward takes the global sample indices (the sampling noise's key)
    documents = True  # packed documents: every document's first token starts a segment (p = b = 1)
    static_decode = True  # decode_step(pos_host=None) skips its one host sync (decode_static.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        c = cfg.concept
        self.mode, self.R = c.boundary_mode, float(c.target_ratio)
        self.temperature, self.threshold = float(c.boundary_temperature), float(c.boundary_threshold)
        self.tau = c.boundary_tau
        self.balance, self.weight = c.balance, float(c.balance_weight)
        self.detach_input = not c.boundary_grad_to_encoder
        d = cfg.d_model
        if self.mode == "predictor":
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, d, bias=False)
        # the previous optimizer step's global (boundaries, tokens): its F for balance: global. Integers,
        # so no precision cast touches them; persistent, so a resumed run continues exactly
        self.register_buffer("rate_counts", torch.zeros(2, dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.mode == "predictor":
            with torch.no_grad():
                nn.init.eye_(self.q.weight)
                nn.init.eye_(self.k.weight)

    # ---- boundaries ----

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query side, key side) of the boundary test: (W_q h, W_k h), or (h, h) by the rule."""
        if self.mode == "boundary":
            return h, h
        x = h.detach() if self.detach_input else h
        return self.q(x), self.k(x)

    def probabilities(self, h: torch.Tensor) -> torch.Tensor:
        """p (B, T): p_0 = 1, p_t = (1 - cos(q[t-1], k[t]))/2 clamped to [0, 1]."""
        q, k = self._project(h)
        p = ((1 - cosine(_wide(q[:, :-1]), _wide(k[:, 1:]))) / 2).clamp(0, 1)  # (B, T-1), at least fp32
        return torch.cat([p.new_ones(p.shape[0], 1), p], dim=1)

    def decide(self, p: torch.Tensor, sample_ids: torch.Tensor | None) -> torch.Tensor:
        """Boundaries b (B, T) bool from p (detached): sampled in training (predictor), else a threshold."""
        p = p.detach()
        if self.mode == "boundary":
            b = p >= self.tau
        elif not self.training:
            b = p >= self.threshold
        else:
            sharp = torch.sigmoid(torch.logit(p, eps=1e-6) / self.temperature)
            u = keyed_uniform(sample_ids, p.shape[1]) if sample_ids is not None else torch.rand_like(p)
            b = u.to(p.device) < sharp
        b[:, 0] = True
        return b

    # ---- segments ----

    def forward(self, h: torch.Tensor, sample_ids: torch.Tensor | None = None,
                doc: torch.Tensor | None = None) -> Segments:
        """``doc`` (B, T): packed documents. A document's first token starts a segment as t = 0 does
        (p = b = 1 there, counted in F and G alike), so no segment spans two documents; a document's
        last segment closes at the next document's first token and no token of that document uses it
        (``Segments.first``): it is the NCP target of the document's previous segment only."""
        p = self.probabilities(h)  # (B, T)
        start = None
        if doc is not None:
            start = torch.ones_like(doc, dtype=torch.bool)
            start[:, 1:] = doc[:, 1:] != doc[:, :-1]
            p = torch.where(start, torch.ones_like(p), p)
        b = self.decide(p, sample_ids)
        if start is not None:
            b = b | start
        seg = self._segments(h, b, None)
        if doc is not None:
            seg.positions = document_concepts(seg, b, seg.closed, doc)  # (B, M) index inside the document
        self._terms(seg, p, b)
        return seg

    def _segments(self, h: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor | None) -> Segments:
        """Pool the closed segments of boundaries b (B, T) (row b real for t < lengths[b])."""
        B, T, _ = h.shape
        ar = torch.arange(T, device=h.device)
        real = None if lengths is None else ar[None] < lengths[:, None]  # (B, T)
        if real is not None:
            b = b & real
        sid = torch.cumsum(b.long(), dim=1) - 1  # (B, T) own segment = segments closed at or before t
        n_closed = sid[:, -1]  # (B,) a row's last segment is still open
        M = int(n_closed.max()) if B else 0  # host sync: the padded concept count
        keep = sid < n_closed[:, None]
        if real is not None:
            keep = keep & real
        if M:
            c, _ = segment_means(h, torch.where(keep, sid, -1), M)  # (B, M, d)
        else:  # no row closed a segment
            c = h.new_zeros(B, 0, h.shape[-1])
        valid = torch.arange(M, device=h.device)[None] < n_closed[:, None]  # (B, M)
        return Segments(c, torch.arange(M, device=h.device)[None], valid=valid, closed=sid, n_closed=n_closed)

    def _terms(self, seg: Segments, p: torch.Tensor, b: torch.Tensor) -> None:
        """Metrics, the per-step statistics and the balance loss of one forward (every token counts).
        The logged means over micro-batches and ranks of ``boundary_rate`` and ``boundary_prob`` are
        the global F and G (equal token counts); that of ``tokens_per_concept`` is a mean of ratios:
        the global value is ``boundary_tokens / boundaries`` of the step statistics."""
        n = float(b.numel())
        bf = b.to(p.dtype)
        count = bf.sum()
        seg.metrics = {"boundary_rate": count.detach() / n, "boundary_prob": p.detach().mean(),
                       "tokens_per_concept": n / count.detach()}
        seg.stats = {"boundaries": count.detach(), "boundary_tokens": p.new_tensor(n),
                     "boundary_prob_sum": p.detach().sum()}
        if self.mode == "boundary":
            return
        if self.balance == "sequence":  # Normal: each row's own F and G
            seg.losses = {"balance_loss": balance_loss(bf.mean(1), p.mean(1), self.R).mean()}
            return
        seg.losses = {"balance_loss": balance_loss(self.previous_rate(p) if self.training else count / n,
                                                   p.mean(), self.R)}

    def previous_rate(self, like: torch.Tensor) -> torch.Tensor:
        """The previous step's global F (a 0-d tensor, no host sync); 1/R before any step."""
        seen, n = self.rate_counts.to(like.device, like.dtype).unbind()
        return torch.where(n > 0, seen / n.clamp_min(1), torch.full_like(n, 1 / self.R))

    # ---- the segmenter's training terms and the per-step hook ----

    def loss_weights(self) -> dict[str, float]:
        return {} if self.mode == "boundary" else {"balance_loss": self.weight}

    def log_keys(self) -> list[LogKey]:
        return [*super().log_keys(), LogKey("boundary_rate"), LogKey("boundary_prob"), LogKey("tokens_per_concept")]

    def stat_keys(self) -> list[str]:
        return ["boundaries", "boundary_tokens", "boundary_prob_sum"]

    def on_step_end(self, stats: dict[str, float]) -> None:
        """The step's global F (totals over every micro-batch and rank): the next step's F."""
        counts = torch.tensor([round(stats["boundaries"]), round(stats["boundary_tokens"])], dtype=torch.long)
        self.rate_counts.copy_(counts)

    # ---- incremental decoding (inference boundaries) ----

    def decode_init(self, B: int, d: int, device, dtype) -> dict:
        # the open segment's running sum and count in fp32 or wider (in bf16, 256 + 1 = 256)
        wide = torch.promote_types(dtype, torch.float32)
        return {"prev": torch.zeros(B, d, device=device, dtype=dtype),  # q (or h) of the previous token
                "sum": torch.zeros(B, d, device=device, dtype=wide),  # h summed over the open segment
                "count": torch.zeros(B, 1, device=device, dtype=wide),
                "n": torch.zeros(B, dtype=torch.long, device=device)}  # closed segments

    def _threshold(self) -> float:
        return self.tau if self.mode == "boundary" else self.threshold

    def decode_prefill(self, state, h, lengths, lengths_host):
        B, T, _ = h.shape
        p = self.probabilities(h)
        b = p >= self._threshold()
        b[:, 0] = True
        seg = self._segments(h, b, lengths)
        rows, last = torch.arange(B, device=h.device), lengths - 1
        open_ = (seg.closed == seg.n_closed[:, None]) & (torch.arange(T, device=h.device)[None] < lengths[:, None])
        state["sum"] = (_wide(h) * open_[..., None]).sum(1)
        state["count"] = open_.sum(1, keepdim=True).to(state["sum"].dtype)
        state["n"] = seg.n_closed.clone()
        state["prev"] = self._project(h[rows, last][:, None])[0][:, 0]
        return seg

    def decode_step(self, state, h, pos, pos_host):
        q, k = self._project(h[:, None])
        p = ((1 - cosine(_wide(state["prev"]), _wide(k[:, 0]))) / 2).clamp(0, 1)
        start = (p >= self._threshold()) | (pos == 0)  # (B,) this token starts a segment
        closed = start & (pos > 0)  # ... so the previous one is over
        concept = (state["sum"] / state["count"].clamp_min(1)).to(h.dtype)
        index = state["n"].clone()
        state["sum"] = torch.where(start[:, None], _wide(h), state["sum"] + h)
        state["count"] = torch.where(start[:, None], torch.ones_like(state["count"]), state["count"] + 1)
        state["n"] = state["n"] + closed.long()
        state["prev"] = q[:, 0]
        if pos_host is None:  # the static step (decode_static.py): no sync, every row steps
            return Closing(closed, concept, index, index, None, None)
        # One host sync per step (a sampling loop syncs for its token anyway): which rows closed a
        # segment (the concept step runs on those rows only, and is skipped when none did: the base
        # model's cost on those steps) and the concepts closed so far, which bound the concept cache
        # the step attends over (not pos + 1).
        *flags, n_max = torch.cat([closed.long(), state["n"].max()[None]]).tolist()
        rows = [b for b, f in enumerate(flags) if f]
        return Closing(closed, concept, index, index, int(n_max) + 1, bool(rows), rows)

