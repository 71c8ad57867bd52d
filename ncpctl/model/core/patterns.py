"""Declared attention patterns: which keys each query may see, as small records.

An objective (objective.py) declares the pattern of every token layer (``Objective.pattern``);
the attention layer receives that record and the context builders map it to the fastest
kernel for the call (``kernel_masks``), so no design names a kernel:

* ``Causal(window)``: key j is visible from query i iff 0 <= pos_i - pos_j < window (None: every
  earlier key), HF's sliding-window rule (the window counts the query itself). On an unpadded,
  uncached sequence no longer than the window this is exactly SDPA's ``is_causal`` (flash kernels
  on a GPU, no mask built): the mask entry is ``None``. Otherwise a boolean mask.
* ``BlockCausal(block, window)``: positions are grouped in blocks of ``block`` (block b holds
  positions b*block .. b*block + block - 1); a query sees every key of its own block and of earlier
  blocks (bidirectional inside a block, causal across blocks), within ``window`` if set. A boolean
  mask; for an uncached sequence on a GPU a FlexAttention ``BlockMask`` (its ``mask_mod``).

A pattern maps to a mask (B|1, 1, Tq, Tk), True = attend, for any query and key positions:
``mask(q_pos, k_pos, k_valid)``; a query always sees itself, so a padding query never has an
empty row (SDPA would return NaN). ``key`` names the pattern in ``Context.masks``: a causal
pattern is named by its window (as the window-keyed masks always were), any other by itself.
New patterns subclass ``Pattern`` (a frozen dataclass: hashable, compared by value).

Documents (``data.document_mask``): a packed window holds several documents, ``doc`` (B, T) the
document index of each position (non-decreasing along a row). Every pattern then also requires
``doc[q] == doc[k]`` (block-diagonal by document: ``document_mod``), one function of (b, h, q, k)
that is FlexAttention's ``mask_mod`` on a GPU (a ``BlockMask`` per batch) and, evaluated on
broadcast index grids, the boolean SDPA mask (B, 1, T, T) on the CPU (``document_masks``). Positions
restart at 0 in each document (``document_positions``), so RoPE and learned positions see each
document as if it were alone; the window rule reads index differences, equal inside a document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def attn_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, k_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean SDPA mask (B|1, 1, Tq, Tk) of ``Causal(window)``, True = attend.

    Key j is visible from query i iff 0 <= pos_i - pos_j < window (HF's sliding-window rule:
    the window counts the query itself) and the key is valid (not padding). A query always
    sees itself, so a padding query never has an empty row (SDPA would return NaN).
    """
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # (B|1, Tq, Tk)
    m = diff >= 0
    if window is not None:
        m = m & (diff < window)
    if k_valid is not None:
        m = m & (k_valid[:, None, :] | (diff == 0))
    return m[:, None]


class Pattern:
    """An attention pattern: ``visible(q_pos, k_pos)`` (..., Tq, Tk) bool over integer positions;
    ``is_causal(T)``: whether, on an unpadded T-token sequence at positions 0..T-1, it is exactly
    SDPA's ``is_causal`` (then no mask is built)."""

    window: int | None = None

    @property
    def key(self) -> Any:
        return self

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def is_causal(self, T: int) -> bool:
        return False

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None) -> torch.Tensor:
        """(B|1, 1, Tq, Tk) for positions q_pos (B|1, Tq), k_pos (B|1, Tk); ``k_valid`` (B, Tk)."""
        m = self.visible(q_pos, k_pos)
        if self.window is not None:
            diff = q_pos[..., :, None] - k_pos[..., None, :]
            m = m & (diff < self.window) & (diff > -self.window)
        self_ = q_pos[..., :, None] == k_pos[..., None, :]
        if k_valid is not None:
            m = m & k_valid[:, None, :]
        return (m | self_)[:, None]


@dataclass(frozen=True)
class Causal(Pattern):
    window: int | None = None

    @property
    def key(self) -> Any:
        return self.window

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return attn_mask(q_pos, k_pos, self.window)[:, 0]

    def is_causal(self, T: int) -> bool:
        return self.window is None or T <= self.window

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None) -> torch.Tensor:
        return attn_mask(q_pos, k_pos, self.window, k_valid)


@dataclass(frozen=True)
class BlockCausal(Pattern):
    block: int = 1
    window: int | None = None

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"BlockCausal: block must be >= 1, got {self.block}")

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return torch.div(k_pos, self.block, rounding_mode="floor")[..., None, :] <= \
            torch.div(q_pos, self.block, rounding_mode="floor")[..., :, None]

    def is_causal(self, T: int) -> bool:
        return self.block == 1 and self.window is None

    def mask_mod(self):
        """``visible`` as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` (positions 0..T-1):
        the same rule as ``mask`` on an unpadded sequence, window included."""
        block, window = self.block, self.window

        def visible(b, h, q, k):
            m = (q // block) >= (k // block)
            if window is not None:
                m = m & (q - k < window) & (k - q < window)
            return m | (q == k)

        return visible


def as_pattern(p: Any) -> Pattern:
    """A pattern as given, or ``Causal(window)`` for a bare window (int or None)."""
    return p if isinstance(p, Pattern) else Causal(p)


def flex_enabled(device: torch.device) -> bool:
    """Whether a pattern with a ``mask_mod`` maps to a FlexAttention ``BlockMask``: on a GPU only
    (FlexAttention has no CPU backward, and the CPU's SDPA with a boolean mask is its fast path).
    On an H200 block-causal attention (block 64, bf16, forward + backward) took 0.82x the masked
    SDPA's time at T=2048 and 0.46x at T=8192 (docs/gpu/README.md)."""
    return device.type == "cuda" and _FLEX_OFF is None


_FLEX_OFF: str | None = None  # why FlexAttention was switched off in this process (disable_flex)


def disable_flex(why: str) -> None:
    """Switch FlexAttention off for this process (boolean masks from now on), with one warning."""
    global _FLEX_OFF
    if _FLEX_OFF is None:
        import warnings

        warnings.warn(f"FlexAttention is off for this run ({why}); block-causal attention uses SDPA with a "
                      "boolean mask", RuntimeWarning, stacklevel=2)
    _FLEX_OFF = why
    _BLOCK_MASKS.clear()


_BLOCK_MASKS: dict = {}  # (pattern, T, device) -> BlockMask: built once per training shape


def block_mask(p: Pattern, T: int, device: torch.device):
    """The FlexAttention ``BlockMask`` of ``p`` over T positions (its ``mask_mod``), cached."""
    key = (p, T, str(device))
    if key not in _BLOCK_MASKS:
        from torch.nn.attention.flex_attention import create_block_mask

        if len(_BLOCK_MASKS) >= 16:  # evaluation at many lengths: keep the newest few
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = create_block_mask(p.mask_mod(), None, None, T, T, device=str(device))
    return _BLOCK_MASKS[key]


def is_block_mask(mask: Any) -> bool:
    return type(mask).__name__ == "BlockMask"


def kernel_masks(patterns, T: int, device: torch.device) -> dict:
    """Masks for a plain (unpadded, uncached) sequence of length T, one per pattern, keyed by
    ``Pattern.key``: ``None`` means SDPA ``is_causal=True`` (flash kernels on a GPU); on a GPU a
    FlexAttention ``BlockMask`` for a pattern with a ``mask_mod`` (``flex_enabled``); otherwise
    an explicit boolean mask (1, 1, T, T) where the pattern is not causal on T tokens."""
    out: dict = {}
    pos = None
    for p in map(as_pattern, patterns):
        if p.is_causal(T):
            out[p.key] = None
        elif flex_enabled(device) and hasattr(p, "mask_mod"):
            out[p.key] = block_mask(p, T, device)
        else:
            pos = torch.arange(T, device=device)[None] if pos is None else pos
            out[p.key] = p.mask(pos, pos)
    return out


def pattern_mod(p: Pattern):
    """``p``'s rule as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` over positions 0..T-1 of an
    unpadded sequence (a query always sees itself): its own ``mask_mod``, or the causal window rule."""
    if hasattr(p, "mask_mod"):
        return p.mask_mod()
    if not isinstance(p, Causal):
        raise TypeError(f"{type(p).__name__} declares no mask_mod: it cannot be masked by documents")
    window = p.window

    def visible(b, h, q, k):
        m = q >= k
        return m if window is None else m & (q - k < window)

    return visible


def document_mod(p: Pattern, doc: torch.Tensor):
    """``p`` restricted to each document: ``mask_mod`` of ``pattern_mod(p)`` and ``doc[b, q] ==
    doc[b, k]``, ``doc`` (B, T) long the document index of each position."""
    base = pattern_mod(p)

    def visible(b, h, q, k):
        return base(b, h, q, k) & (doc[b, q] == doc[b, k])

    return visible


def dense_mask(mask_mod, B: int, T: int, device) -> torch.Tensor:
    """A ``mask_mod`` evaluated on broadcast index grids: the boolean SDPA mask (B, 1, T, T) (the
    mods here are elementwise tensor expressions, so no vmap is needed)."""
    ar = torch.arange(T, device=device)
    b = torch.arange(B, device=device)[:, None, None, None]
    return mask_mod(b, torch.zeros((), dtype=torch.long, device=device), ar[None, None, :, None], ar[None, None, None, :])


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """(B, T) long: each position's index inside its document (0 at every document's first token)."""
    B, T = doc.shape
    ar = torch.arange(T, device=doc.device)[None].expand(B, T)
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(start, ar, torch.zeros_like(ar)).cummax(dim=1).values  # (B, T) index of the doc's start
    return ar - first


def document_masks(patterns, doc: torch.Tensor, flex: bool = True) -> dict:
    """Masks of a packed (unpadded, uncached) batch of documents ``doc`` (B, T), one per pattern keyed
    by ``Pattern.key``: a FlexAttention ``BlockMask`` of ``document_mod`` on a GPU (``flex_enabled``;
    built per batch: the documents change every batch), else the boolean mask (B, 1, T, T) of the
    same function. ``flex=False``: the boolean mask everywhere (a sequence whose length changes
    from batch to batch, DLCM's concepts: the compiled FlexAttention is specialised to one length)."""
    B, T = doc.shape
    out: dict = {}
    for p in map(as_pattern, patterns):
        mod = document_mod(p, doc)
        if flex and flex_enabled(doc.device):
            out[p.key] = batch_block_mask(mod, B, T, doc.device)
        else:
            out[p.key] = dense_mask(mod, B, T, doc.device)
    return out


_CREATE: dict = {}  # device type -> create_block_mask, compiled where it is built every batch


def batch_block_mask(mod, B: int, T: int, device: torch.device):
    """The ``BlockMask`` of a per-batch ``mask_mod`` (B rows of T positions). Eager
    ``create_block_mask`` first materialises the whole (B, 1, T, T) boolean mask (at T 4096, B 2:
    1.8 s and ~400 MB on a CPU, every batch); compiled, it evaluates the mod block by block. The
    mod closes over the batch's tensors, which dynamo takes as inputs: one graph per shape
    (tests/model/test_documents.py). A compile failure falls back to the eager builder."""
    from torch.nn.attention.flex_attention import create_block_mask

    fn = _CREATE.get(device.type)
    if fn is None:
        fn = _CREATE[device.type] = torch.compile(create_block_mask, dynamic=False)
    try:
        return fn(mod, B, None, T, T, device=str(device))
    except Exception as e:  # an inductor failure must not stop training: build it eagerly from now on
        if fn is create_block_mask:
            raise
        import warnings

        warnings.warn(f"document masks are built eagerly from now on (compiling create_block_mask failed: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:300], RuntimeWarning, stacklevel=2)
        _CREATE[device.type] = create_block_mask
        return create_block_mask(mod, B, None, T, T, device=str(device))


def step_masks(patterns, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None) -> dict:
    """Explicit masks of padded or cached calls (prefill, decoding steps), keyed by ``Pattern.key``."""
    return {p.key: p.mask(q_pos, k_pos, k_valid) for p in map(as_pattern, patterns)}
