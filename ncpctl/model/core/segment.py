"""Segmentation: how token states become concepts (extension point ``concept.segmentation``).

A ``Segmenter`` pools the encoder output h (B, T, d) into concepts c (B, M, d) and says, for
every token, how many segments are *closed* at or before it: token t may use the processed
concepts 0 .. closed(t) - 1 and never its own segment's (../shared/docs/ncp-model.md
sections 1 and 8). Fixed blocks close at their last token (block j at t = j*k + k - 1,
which is causal because h[t] depends on x[0..t] only); a data-dependent segment, whose end is
known only when the next one starts, closes at the token after its last one.

Rows may hold different numbers of concepts: ``Segments.valid`` (B, M) marks the real ones,
and the padding concepts of a row come after its real ones, so the concept transformer's
causal mask keeps them out of every real concept's output.

Incremental decoding has its own per-row, device-side update (``decode_step``): given the
new token's h it says which rows closed a segment, the pooled concept and its index. It may
also say, from host integers, whether any row can have closed (fixed blocks know this from
the positions), which lets the decoder skip the concept step without a device sync; a
data-dependent segmenter answers ``None`` and the step runs for every row (rows that closed
nothing write a throw-away entry at their next concept index, overwritten when it closes).
A segmenter that sets ``static_decode`` also takes ``pos_host=None`` (the static-shape step of
decode_static.py, replayed as a CUDA graph): then it reads nothing on the host, syncs nothing, and
answers ``any``, ``rows`` and ``length`` None (every row steps; the caller bounds the cache).

``FixedBlocks`` is ConceptLM's segmentation; its reshape is the fast path, and nothing outside
it assumes a fixed k (accounting and cache sizes read its ``law``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.config import ModelConfig, SegmentationLaw
from ncpctl.model.core.spec import FIXED_BLOCKS
from ncpctl.model.core.outputs import LogKey
from ncpctl.model.core.patterns import document_positions


@dataclass
class Segments:
    """Concepts of a batch and how tokens see them.

    ``concepts`` (B, M, d) pooled states; ``positions`` (B|1, M) RoPE positions of the concept
    transformer; ``valid`` (B, M) bool, None when every concept is real; ``closed`` (B, T) long,
    segments closed at or before each token (None when the segmenter spreads by its own law);
    ``n_closed`` (B,) long, closed concepts within each row's real tokens (decoding prefill);
    ``lengths`` (B,) long, each row's real tokens (set by the decoder's prefill, for couplings).
    Packed documents (``doc_ids``): ``docs`` (B, M) long, each concept's document (padding concepts
    get distinct ids >= T, after the real ones, so a row stays sorted and a padding concept is alone
    in its document); ``first`` (B, T) long, the concepts of earlier documents before each token:
    token t may use concepts first(t) .. closed(t) - 1 only (its own document's closed ones).
    ``losses``/``metrics``/``stats`` are the segmenter's own terms (see outputs.py).
    """

    concepts: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None = None
    closed: torch.Tensor | None = None
    n_closed: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    docs: torch.Tensor | None = None
    first: torch.Tensor | None = None
    losses: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def pairs(self) -> torch.Tensor | None:
        """(B, M-1) bool: concept j+1 is a target of pred[j] (both real, one document); None: all."""
        if self.valid is None:
            return None
        pair = self.valid[:, :-1] & self.valid[:, 1:]
        return pair if self.docs is None else pair & (self.docs[:, :-1] == self.docs[:, 1:])


def document_concepts(seg: Segments, at: torch.Tensor, index: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Set ``seg.docs`` and ``seg.first`` of packed documents ``doc`` (B, T), the concepts' document
    read at the tokens ``at`` (B, T) bool, where token t belongs to concept ``index[t]`` (values
    beyond M - 1 are ignored); ``seg.valid`` (B, M) must be set. Returns each concept's index inside
    its document (B, M) (0 for padding), for its RoPE position."""
    B, T = doc.shape
    M = seg.valid.shape[1]
    docs = doc.new_zeros(B, M + 1)
    docs.scatter_(1, torch.where(at, index, M).clamp(0, M), doc)  # column M: a throw-away slot
    pad = T + torch.arange(M, device=doc.device)[None]  # distinct, above every real document index
    seg.docs = torch.where(seg.valid, docs[:, :M], pad).contiguous()  # (B, M) sorted along each row
    seg.first = torch.searchsorted(seg.docs, doc.contiguous())  # (B, T) concepts of earlier documents
    return torch.arange(M, device=doc.device)[None] - torch.searchsorted(seg.docs, seg.docs)


@dataclass
class Closing:
    """What one decoding step closed, per row: ``closed`` (B,) bool, the pooled ``concept``
    (B, d) and its ``index`` (B,) long and RoPE ``position`` (B,) (rows that closed nothing:
    their next index, where a throw-away entry may be written); ``length``: a host bound on
    the concept cache length after this step (None: unknown, ``pos_host`` was None: the cache's
    capacity); ``any``: host knowledge whether a row closed
    (None: unknown without a device sync); ``rows``: host knowledge of which rows closed
    (None: unknown), so the concept step can run on those rows only."""

    closed: torch.Tensor
    concept: torch.Tensor
    index: torch.Tensor
    position: torch.Tensor
    length: int | None
    any: bool | None
    rows: list[int] | None = None


class Segmenter(nn.Module):
    """The segmentation interface. Subclasses set ``law`` (a ``SegmentationLaw``) and
    implement ``forward``, ``decode_init``, ``decode_prefill`` and ``decode_step``."""

    law: SegmentationLaw
    # True: ``forward(h, doc=...)`` takes packed documents (B, T) and sets ``Segments.docs``/``first``
    documents = False
    owns_init = False  # True: NCPModel.init_weights leaves this module to its reset_parameters
    # True: ``forward(h, sample_ids=...)`` also receives each row's global sample index (B,) or None,
    # the key of sampling noise that must not depend on the rank or the batch position (DLCM)
    keyed = False
    # True: ``decode_step`` takes ``pos_host=None`` and then makes no host sync (the static decode step)
    static_decode = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, h: torch.Tensor) -> Segments:
        """Encoder output h (B, T, d) of unpadded rows -> Segments (``closed`` (B, T) set
        unless ``spread`` is overridden)."""
        raise NotImplementedError

    def spread(self, seg: Segments, x: torch.Tensor, T: int) -> torch.Tensor:
        """Per-concept values x (B, M, e) -> per-token (B, T, e): token t gets x[closed(t) - 1],
        zeros while nothing is closed (the causal shift of ncp-model.md section 1)."""
        B, M, e = x.shape
        idx = (seg.closed - 1).clamp(0, max(M - 1, 0))  # (B, T)
        out = x.gather(1, idx[..., None].expand(B, T, e)) if M else x.new_zeros(B, T, e)
        lo = 0 if seg.first is None else seg.first  # packed documents: never an earlier document's concept
        return out * (seg.closed > lo)[..., None].to(x.dtype)

    def max_concepts(self, T: int) -> int:
        return self.law.concepts(self.cfg.concept, T)

    def closed_counts(self, seg: Segments, T: int) -> torch.Tensor:
        """(B, T) long: segments closed at or before each token (``Segments.closed``)."""
        return seg.closed

    # ---- the segmenter's own training terms (e.g. DLCM's load balancing) ----

    def loss_weights(self) -> dict[str, float]:
        """Weight of each term the segmenter puts in ``Segments.losses`` (in the total loss)."""
        return {}

    def log_keys(self) -> list[LogKey]:
        """Everything the segmenter puts in ``Segments.losses`` and ``.metrics``, declared once."""
        return [LogKey(name) for name in self.loss_weights()]

    def stat_keys(self) -> list[str]:
        """Names of the per-step global statistics in ``Segments.stats`` (local sums)."""
        return []

    def on_step_end(self, stats: dict[str, float]) -> None:
        """Totals of ``stat_keys`` over every micro-batch of the step on every rank."""

    # ---- incremental decoding ----

    def decode_init(self, B: int, d: int, device, dtype) -> dict:
        """The per-row decoding state (a dict of (B, ...) tensors: beam search reorders rows)."""
        raise NotImplementedError

    def decode_prefill(self, state: dict, h: torch.Tensor, lengths: torch.Tensor, lengths_host: list[int]) -> Segments:
        """Right-padded prompts h (B, T, d) (row b real for t < lengths[b]) -> Segments over all T
        slots with ``n_closed`` set; leaves ``state`` ready for the token after each prompt."""
        raise NotImplementedError

    def decode_step(self, state: dict, h: torch.Tensor, pos: torch.Tensor, pos_host: list[int] | None) -> Closing:
        """The new token of each row: h (B, d) at positions ``pos`` (B,) (also as host ints; None:
        not known on the host, only with ``static_decode``)."""
        raise NotImplementedError


def segment_means(h: torch.Tensor, seg_id: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of h (B, T, d) over each segment: ``seg_id`` (B, T) in [0, M) or -1 (not pooled).
    Returns (means (B, M, d), token counts (B, M)); empty segments give zeros.

    The sums are one batched GEMM of the (B, M, T) segment indicator with h: deterministic on
    every device and accumulated in fp32 for bf16 inputs (a scatter-add would round every
    addition in bf16, where 256 + 1 = 256, and uses atomics in an order that varies on a GPU);
    the counts are exact integers."""
    member = seg_id[:, None, :] == torch.arange(M, device=h.device)[None, :, None]  # (B, M, T); -1 is in none
    counts = member.sum(-1)  # (B, M)
    sums = torch.bmm(member.to(h.dtype), h)  # (B, M, d)
    return sums / counts.clamp_min(1)[..., None].to(h.dtype), counts.to(h.dtype)


class FixedBlocks(Segmenter):
    """Blocks of k tokens (ConceptLM): c[j] = mean(h[j*k : j*k+k]); a trailing partial block is
    not pooled; block j closes at its last token, so token t sees blocks 0 .. (t+1)//k - 1."""

    law = FIXED_BLOCKS
    documents = True
    static_decode = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.k = cfg.concept.k
        self.scale_positions = cfg.concept.rope_scale_by_k

    def positions(self, j: torch.Tensor) -> torch.Tensor:
        return j * self.k if self.scale_positions else j

    def forward(self, h: torch.Tensor, doc: torch.Tensor | None = None) -> Segments:
        if doc is not None:
            return self._documents(h, doc)
        B, T, d = h.shape
        k, M = self.k, T // self.k
        c = h[:, : M * k].reshape(B, M, k, d).mean(dim=2)  # (B, M, d)
        step = k if self.scale_positions else 1  # self.positions(arange(M)) in one kernel
        return Segments(c, torch.arange(0, M * step, step, device=h.device)[None])

    def _documents(self, h: torch.Tensor, doc: torch.Tensor) -> Segments:
        """Packed documents ``doc`` (B, T): blocks of k tokens counted from each document's start. A
        block that a document's end (or the window's) cuts short is dropped, as a trailing partial
        block always is: every concept is a mean of exactly k tokens of one document; the tokens of a
        cut block still receive their document's latest closed concept."""
        B, T, d = h.shape
        k, M = self.k, T // self.k
        r = document_positions(doc)  # (B, T) index inside the document
        end = r % k == k - 1  # (B, T) last token of a complete block
        closed = end.long().cumsum(1)  # (B, T) blocks closed at or before t
        n = closed[:, -1]  # (B,) complete blocks per row
        valid = torch.arange(M, device=h.device)[None] < n[:, None]  # (B, M)
        ends = torch.full((B, M + 1), k - 1, dtype=torch.long, device=h.device)
        ends.scatter_(1, torch.where(end, closed - 1, M), torch.arange(T, device=h.device)[None].expand(B, T))
        idx = (ends[:, :M, None] - (k - 1) + torch.arange(k, device=h.device)).reshape(B, M * k)  # block tokens
        c = h.gather(1, idx[..., None].expand(B, M * k, d)).reshape(B, M, k, d).mean(dim=2)  # (B, M, d)
        seg = Segments(c * valid[..., None].to(c.dtype), h.new_zeros(0), valid=valid, closed=closed)
        seg.positions = self.positions(document_concepts(seg, end, closed - 1, doc))  # (B, M), 0 per document
        return seg

    def spread(self, seg: Segments, x: torch.Tensor, T: int) -> torch.Tensor:
        if seg.first is not None:  # packed documents: the general rule, by closed counts
            return super().spread(seg, x, T)
        return shift_blocks(x, self.k, T)

    def closed_counts(self, seg: Segments, T: int) -> torch.Tensor:
        if seg.closed is not None:
            return seg.closed
        B = seg.concepts.shape[0]
        return ((torch.arange(T, device=seg.concepts.device) + 1) // self.k)[None].expand(B, T)

    def decode_init(self, B: int, d: int, device, dtype) -> dict:
        # h summed over the open block, in fp32 or wider (the forward's mean accumulates so too)
        return {"sum": torch.zeros(B, d, device=device, dtype=torch.promote_types(dtype, torch.float32))}

    def decode_prefill(self, state, h, lengths, lengths_host):
        B, T, d = h.shape
        k, M = self.k, T // self.k
        seg = self.forward(h)  # right padding: a row's junk blocks come after its real ones
        seg.n_closed = lengths // k  # (B,) complete blocks per row
        ar = torch.arange(T, device=h.device)
        in_open = (ar[None] >= (seg.n_closed * k)[:, None]) & (ar[None] < lengths[:, None])
        state["sum"] = (h.to(state["sum"].dtype) * in_open[..., None]).sum(dim=1)  # (B, d)
        return seg

    def decode_step(self, state, h, pos, pos_host):
        k = self.k
        state["sum"] = state["sum"] + h
        done = pos % k == k - 1  # (B,) the block ends at this token
        c = (state["sum"] / k).to(h.dtype)  # (B, d) the pooled block (junk where not done)
        state["sum"] = state["sum"].masked_fill(done[:, None], 0.0)
        j = pos // k
        if pos_host is None:  # the static step: every row steps, the caller bounds the cache
            return Closing(done, c, j, self.positions(j), None, None)
        # host ints tell whether any row completes a block: no device sync
        rows = [b for b, p in enumerate(pos_host) if p % k == k - 1]
        return Closing(done, c, j, self.positions(j), max(p // k for p in pos_host) + 1, bool(rows), rows)


def shift_blocks(pred: torch.Tensor, k: int, T: int) -> torch.Tensor:
    """Causal shift (spec 1): position p gets pred[(p+1)//k - 1], zeros for p < k-1.

    Each pred repeated k times (B, M k, d), then k-1 zero positions in front and cut (or padded) to
    T: (B, M, d) -> (B, T, d). One pad does both (a negative pad crops), so the shift is two kernels
    forward and two backward.
    """
    B, M, d = pred.shape
    rep = pred[:, :, None].expand(B, M, k, d).reshape(B, M * k, d)
    return F.pad(rep, (0, 0, k - 1, T - (k - 1) - M * k))
