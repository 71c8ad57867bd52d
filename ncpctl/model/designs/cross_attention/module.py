"""DLCM's token-to-concept cross-attention coupling (``concept.coupling: cross_attention``; the
extension point: core/coupling.py): every decoder block gets a sub-layer that attends from the
tokens to the concepts closed so far, ``per_concept`` (a softmax over the visible concepts) or
``replicated`` (DLCM Sec. 4.1's kernel: each concept's key/value copied onto the next segment's
tokens); ncp-model.md section 8."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.coupling import Coupling
from ncpctl.model.core.layers import RMSNorm
from ncpctl.model.designs.cross_attention.config import PAD as _PAD  # the extra q/k coordinates (a multiple of 8: flash kernels)


# An extra query/key coordinate of 1 against -_FAR puts a key's score at -_FAR / sqrt(hd) (below
# -1000 for head dims up to 256): exp() of it is exactly 0 in fp32, so the key is out of the
# softmax while the mask stays SDPA's plain causal one. 2^14: exact in bf16 and fp16 (no inf, so a
# row with no valid key is uniform over zero values, not a NaN).
_FAR = float(2 ** 14)


def per_concept_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, closed: torch.Tensor,
                          first: torch.Tensor | None = None) -> torch.Tensor:
    """``per_concept``: q (B, H, T, hd) over the concepts k, v (B, H, M, hd), token t seeing
    concepts 0 .. closed[t] - 1 once each (SDPA with a (B, 1, T, M) boolean mask) -> (B, H, T, hd),
    exactly zero where closed[t] = 0. ``first`` (B, T) (packed documents): token t sees concepts
    first[t] .. closed[t] - 1 only, its own document's."""
    M = k.shape[2]
    ar = torch.arange(M, device=closed.device)
    vis = ar < closed[..., None]  # (B, T, M)
    seen = closed > 0  # (B, T)
    if first is not None:
        vis = vis & (ar >= first[..., None])
        seen = closed > first
    mask = (vis | ~seen[..., None])[:, None]  # rows that see nothing attend anywhere ...
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * seen[:, None, :, None].to(q.dtype)  # ... x 0


def replicated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, closed: torch.Tensor,
                         first: torch.Tensor | None = None) -> torch.Tensor:
    """``replicated`` (DLCM Sec. 4.1's kernel): concept j's key/value copied onto the positions of
    segment j+1 (the tokens with closed = j+1: never onto its own segment), then ONE attention over
    the T token-aligned keys under the plain causal mask (``is_causal``: flash kernels), so token t
    weighs concept j by its copies at positions <= t. Segment 0 carries no concept: its key slots
    get the extra coordinate -_FAR (exactly out of the softmax) and zero values, and its tokens'
    outputs are zeroed. Shapes as ``per_concept_attention``; memory (B, H, T, hd + _PAD) for the
    copies, as the paper's kernel. ``first`` (B, T) (packed documents): a slot carries a concept
    only when it is its own document's (closed > first), and token t reads only slots whose concept
    is at least first[t] (an explicit (B, 1, T, T) mask instead of ``is_causal``; a query always sees
    its own slot, so no row is empty)."""
    B, H, T, hd = q.shape
    valid = closed > (0 if first is None else first)  # (B, T) the slot carries concept closed - 1
    idx = (closed - 1).clamp_min(0)[:, None, :, None].expand(B, H, T, hd)
    kr, vr = k.gather(2, idx), v.gather(2, idx) * valid[:, None, :, None].to(v.dtype)  # (B, H, T, hd)
    ext_q = q.new_zeros(B, H, T, _PAD)
    ext_q[..., 0] = 1
    ext_k = q.new_zeros(B, H, T, _PAD)
    ext_k[..., 0] = torch.where(valid, 0.0, -_FAR).to(q.dtype)[:, None]
    mask = None
    if first is not None:
        ar = torch.arange(T, device=q.device)
        mask = ((ar[:, None] >= ar[None]) & (closed[:, None, :] > first[:, :, None]))[:, None]  # (B, 1, Tq, Tk)
        mask = mask | (ar[:, None] == ar[None])
    y = F.scaled_dot_product_attention(torch.cat([q, ext_q], -1), torch.cat([kr, ext_k], -1),
                                       torch.cat([vr, torch.zeros_like(ext_q)], -1), attn_mask=mask,
                                       is_causal=mask is None, scale=hd ** -0.5)[..., :hd]
    return y * valid[:, None, :, None].to(q.dtype)


def copies_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """The replicated form from copy counts, for decoding steps (a query per row, T = 1): the
    softmax over the M concepts with the bias log(copies) (what repeated keys do to a softmax),
    computed in fp32 (log of a count in bf16 is off by up to 2%; T = 1 makes it cheap); copies
    (B, T, M), 0 = invisible. -> (B, H, T, hd) in q's dtype, zero where no concept is visible."""
    wide = torch.promote_types(q.dtype, torch.float32)
    seen = (copies > 0).any(-1)  # (B, T)
    bias = torch.where(copies > 0, copies.to(wide).log(), torch.full_like(copies, float("-inf"), dtype=wide))
    bias = torch.where(seen[..., None], bias, torch.zeros_like(bias))[:, None]  # (B, 1, T, M)
    y = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide), attn_mask=bias)
    return (y * seen[:, None, :, None].to(wide)).to(q.dtype)


class CrossAttentionCoupling(Coupling):
    """DLCM Sec. 3.5.2, Eq. 14: z = h + W_O softmax(q k^T / sqrt(hd) + mask) v, ONE causal
    cross-attention from every token to the processed concepts closed at that token, added to
    the encoder states before the token decoder (so the decoder blocks stay plain).

    q = W_Q h (B, H, T, hd), k = W_K pred, v = W_V pred (B, H, M, hd) with H = n_heads token heads,
    RMSNorm per head on q and k (DLCM Sec. 4); no RoPE (the mask carries the order). Token t
    sees concepts 0 .. closed(t) - 1, never its own segment's (ncp-model.md section 8); a token
    that sees none gets exactly zero (the masked row is not a NaN). The memory is ``pred`` (B, M, d),
    what the concept path hands every coupling (the concept heads' mix of codes).

    ``concept.cross_attention`` declares which attention the model is, the same function on every
    machine (the device picks only the kernel SDPA runs):
    * ``per_concept`` (the default, Eq. 14): a softmax over the visible concepts, each once
      (``per_concept_attention``: SDPA over M with a (T, M) boolean mask: on a GPU a fused masked
      kernel, memory-efficient attention, as flash kernels take no mask);
    * ``replicated`` (DLCM Sec. 4.1's kernel, ``replicated_attention``): concept j's key/value copied
      onto the tokens at which it is the latest closed concept (segment j+1), under the plain
      causal mask, so each concept weighs by its visible copies. Decoding keeps each row's copy
      counts (every new token adds one copy of its latest closed concept) and attends with the
      equivalent bias log(copies) (``copies_attention``).

    Concept smoothing (Sec. 3.5.1; the paper does not specify it): a causal two-tap filter over the
    concept sequence, z~_j = z_j + s * z_{j-1} (z_{-1} = 0) with a learned per-dimension s, zero at
    init (no smoothing). Concept j-1 closed before concept j, so z~_j is visible exactly when z_j
    is; it reads no boundary probability, so the LM loss still cannot reach the predictor.
    """

    static_decode = True  # its key/value store grows to closing.length once, then keeps its shape

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d, self.H = cfg.d_model, cfg.n_heads
        self.hd = d // self.H
        self.replicated = cfg.concept.cross_attention == "replicated"
        self.wq = nn.Linear(d, d, bias=False)
        self.wkv = nn.Linear(d, 2 * d, bias=False)
        self.fused_rows = {"wkv": (d, d)}  # [k; v] (keys_values), each its own matrix to Muon
        self.wo = nn.Linear(d, d, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.norm_eps), RMSNorm(self.hd, cfg.norm_eps)
        self.smooth = nn.Parameter(torch.zeros(d))  # concept smoothing, zero = none (init_weights keeps it)

    def smoothed(self, mem: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """Concepts (B, M, d) -> z~ (B, M, d): z_j + s * z_{j-1}, causal over the concept index;
        ``docs`` (B, M) (packed documents): z_{j-1} of another document counts as 0."""
        prev = torch.cat([mem.new_zeros(mem.shape[0], 1, mem.shape[2]), mem[:, :-1]], dim=1)
        if docs is not None:
            same = torch.cat([torch.zeros_like(docs[:, :1], dtype=torch.bool), docs[:, 1:] == docs[:, :-1]], dim=1)
            prev = prev * same[..., None].to(prev.dtype)
        return mem + self.smooth * prev

    def keys_values(self, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Concepts (B, M, d) -> k, v (B, H, M, hd), k normed per head."""
        B, M, _ = mem.shape
        k, v = self.wkv(mem).view(B, M, 2, self.H, self.hd).unbind(2)
        return self.k_norm(k).transpose(1, 2), v.transpose(1, 2)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens x (B, T, d) -> q (B, H, T, hd), normed per head."""
        B, T, _ = x.shape
        return self.q_norm(self.wq(x).view(B, T, self.H, self.hd)).transpose(1, 2)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        """Heads y (B, H, T, hd) joined and projected back: W_O y, (B, T, d)."""
        B, _, T, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, closed: torch.Tensor,
               first: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens x (B, T, d) of a whole sequence to concepts k, v (B, H, M, hd), token t seeing
        concepts 0 .. closed[t] - 1 (closed (B, T)), in the declared form -> (B, T, d); ``first``
        (B, T): packed documents, token t sees first[t] .. closed[t] - 1."""
        form = replicated_attention if self.replicated else per_concept_attention
        return self._out(form(self.queries(x), k, v, closed, first))

    @staticmethod
    def copies(closed: torch.Tensor, M: int) -> torch.Tensor:
        """closed (B, T) -> (B, T, M): copies of concept j visible at t = #{s <= t: closed(s) = j + 1}
        (> 0 exactly when j < closed(t), closed being non-decreasing)."""
        one = F.one_hot(closed.clamp_max(M), M + 1)[..., 1:]  # (B, T, M) closed(s) == j + 1
        return one.cumsum(1)

    def forward(self, h, pred, seg, segmenter) -> torch.Tensor:
        if pred is None:  # no concept closed in any row
            return h
        closed = segmenter.closed_counts(seg, h.shape[1])
        k, v = self.keys_values(self.smoothed(pred, seg.docs))
        return h + self.attend(h, k, v, closed, seg.first)

    # ---- incremental decoding: each row's concept keys/values and closed count ----

    def decode_state(self, pred, seg, segmenter, like) -> dict:
        B, Tp = like.shape[0], like.shape[1]
        last = like.new_zeros(B, like.shape[-1])  # the latest closed concept (smoothing's z_{j-1})
        if pred is None:
            k = v = like.new_zeros(B, self.H, 0, self.hd)
        else:
            k, v = self.keys_values(self.smoothed(pred))
            n = seg.n_closed
            at = pred[torch.arange(B, device=pred.device), (n - 1).clamp_min(0)]
            last = torch.where((n > 0)[:, None], at, last)
        state = {"k": k, "v": v, "n": seg.n_closed.clone(), "last": last}
        if self.replicated:  # copies of each concept among the prompt's real tokens (B, M)
            closed = segmenter.closed_counts(seg, Tp)  # aligned layout: row b real for t < lengths[b]
            real = torch.arange(Tp, device=like.device)[None] < seg.lengths[:, None]
            state["copies"] = self.copies(torch.where(real, closed, 0), k.shape[2])[:, -1]
        return state

    def decode_update(self, state, closing, pred) -> None:
        # the concept at closing.index, smoothed with the row's previous one: (B, H, 1, hd)
        k, v = self.keys_values((pred + self.smooth * state["last"])[:, None])
        state["last"] = torch.where(closing.closed[:, None], pred, state["last"])
        K, V = state["k"], state["v"]
        if closing.length > K.shape[2]:  # room for index < length: grow by doubling (amortised O(M) copies)
            more = max(closing.length - K.shape[2], K.shape[2])
            grow = K.new_zeros(K.shape[0], K.shape[1], more, K.shape[3])
            K, V = torch.cat([K, grow], 2), torch.cat([V, grow], 2)
            if "copies" in state:
                state["copies"] = torch.cat([state["copies"], state["copies"].new_zeros(K.shape[0], more)], 1)
        rows, j = torch.arange(K.shape[0], device=K.device), closing.index
        keep = closing.closed[:, None, None]  # (B, 1, 1) against (B, H, hd)
        K[rows, :, j] = torch.where(keep, k[:, :, 0], K[rows, :, j])
        V[rows, :, j] = torch.where(keep, v[:, :, 0], V[rows, :, j])
        state["k"], state["v"] = K, V
        state["n"] = torch.where(closing.closed, closing.index + 1, state["n"])

    def decode_input(self, h, state) -> torch.Tensor:
        M = state["k"].shape[2]
        if M == 0:
            return h
        # slots past a row's n (not closed yet, or spare room) are invisible
        q, k, v = self.queries(h), state["k"], state["v"]
        if "copies" not in state:  # per_concept: the new token sees concepts 0 .. n - 1
            return h + self._out(per_concept_attention(q, k, v, state["n"][:, None]))
        # replicated: the new token is one more copy of its latest closed concept (none while n = 0)
        latest = torch.arange(M, device=h.device)[None] == (state["n"] - 1)[:, None]  # (B, M)
        state["copies"] = state["copies"] + latest.long()
        return h + self._out(copies_attention(q, k, v, state["copies"][:, None]))
