"""Incremental decoding with KV caches (spec section 5); exact vs the full forward.

Batch layout: prompts are LEFT-padded onto one shared slot axis. Row b has ``pad[b]``
padding slots, then its tokens: the token in slot s has position p = s - pad[b]. All rows
advance one slot per step, so the token-layer caches (encoder, decoder) share one write
index ``state.slot``; RoPE uses the per-row positions and padding keys are masked out, so
every row computes what it would alone.

The concept path runs per row ("per-row block phase"): row b completes a block when
p % k == k-1, at a different step than other rows. Its concept cache is indexed by the
row's own block number j = p // k and written with a per-row index; rows that did not
complete a block in a step compute a throw-away concept step (written at their next,
not yet valid, block slot, overwritten when that block completes) and keep their pred.
Pads are host ints, so which rows complete a block is known on the host: no device sync.

Per row the state holds (spec 5): encoder/decoder/concept KV caches, the sum of h over the
unfinished block, and the current pred (already normed for ``add: normed``; zeros before
the first block completes). The codebook is computed once at prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ncpctl.model.concept import shift_blocks
from ncpctl.model.layers import KVCache, attn_mask, causal_masks, rope, run_stack, stack_windows


@dataclass
class DecodeState:
    pad: list[int]  # host: padding slots per row
    pad_t: torch.Tensor  # (B,) the same on the device
    slot: int  # next slot to write, shared by all rows
    capacity: int  # slots the token caches hold (padded prompt + new tokens)
    enc: list[KVCache]
    dec: list[KVCache]
    con: list[KVCache]
    codes: torch.Tensor | None = None  # (S, N, ds)
    block_sum: torch.Tensor | None = None  # (B, d) sum of h over the unfinished block
    pred: torch.Tensor | None = None  # (B, d) concept term added to the next token

    @property
    def lengths(self) -> list[int]:
        """Tokens seen so far per row."""
        return [self.slot - p for p in self.pad]


def _caches(model, n: int, batch: int, capacity: int, device, dtype) -> list[KVCache]:
    cfg = model.cfg
    return [KVCache(batch, cfg.n_kv_heads, capacity, cfg.head_dim, device, dtype) for _ in range(n)]


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, lengths, max_len: int) -> tuple[torch.Tensor, DecodeState]:
    """Run left-padded prompts tokens (B, Tp) (row b's real tokens are its last lengths[b]
    slots) and allocate caches for ``max_len`` slots in all. Returns logits (B, Tp, V)
    (padding slots hold junk) and the state for ``step``."""
    cfg = model.cfg
    B, Tp = tokens.shape
    dev = tokens.device
    lengths = [int(n) for n in lengths]
    if len(lengths) != B or min(lengths) < 1 or max(lengths) > Tp:
        raise ValueError(f"lengths must be {B} values in [1, {Tp}], got {lengths}")
    if max_len < Tp:
        raise ValueError(f"max_len={max_len} is shorter than the prompt ({Tp} slots)")
    pad = [Tp - n for n in lengths]
    dtype = model.embed.weight.dtype
    n_con = len(model.concept.layers) if model.concept is not None else 0
    st = DecodeState(
        pad=pad, pad_t=torch.tensor(pad, device=dev), slot=Tp, capacity=max_len,
        enc=_caches(model, len(model.encoder), B, max_len, dev, dtype),
        dec=_caches(model, len(model.decoder), B, max_len, dev, dtype),
        con=_caches(model, n_con, B, max_len // cfg.concept.k + 1, dev, dtype),
    )
    slots = torch.arange(Tp, device=dev)
    valid = slots[None] >= st.pad_t[:, None]  # (B, Tp) real tokens
    x = model.embed(tokens)  # (B, Tp, d)
    cos, sin = rope((slots[None] - st.pad_t[:, None]).clamp_min(0), cfg, x.dtype)
    masks = {w: attn_mask(slots[None], slots[None], w, valid) for w in stack_windows(model.token_layers())}
    x = run_stack(model.encoder, x, cos, sin, masks, st.enc, 0, Tp)
    if model.concept is not None:
        x = _concept_prefill(model.concept, st, x, lengths, valid)
    x = run_stack(model.decoder, x, cos, sin, masks, st.dec, 0, Tp)
    return model.lm_head(model.final_norm(x)), st


def _concept_prefill(cm, st: DecodeState, h: torch.Tensor, lengths: list[int], valid: torch.Tensor) -> torch.Tensor:
    """Concept path over the prompts; fills the concept cache, block sums and current pred."""
    B, Tp, d = h.shape
    k, dev = cm.k, h.device
    ar = torch.arange(Tp, device=dev)
    # slot layout -> aligned layout (index = position, rows right-padded), (B, Tp, d)
    src = (ar[None] + st.pad_t[:, None]).clamp_max(Tp - 1)
    h_al = h.gather(1, src[..., None].expand(B, Tp, d))
    n_blocks = torch.tensor(lengths, device=dev) // k  # (B,) complete blocks per row
    st.codes = cm.codebook()
    Mp = Tp // k
    if Mp > 0:
        # Right padding: a row's junk blocks (past its length) come after its real ones, so
        # the plain causal mask keeps them out of every real block's output.
        c = h_al[:, : Mp * k].reshape(B, Mp, k, d).mean(dim=2)  # (B, Mp, d)
        cos, sin = rope(cm.positions(torch.arange(Mp, device=dev))[None], cm.cfg, h.dtype)
        masks = causal_masks(stack_windows(cm.layers), Mp, dev)
        u = run_stack(cm.layers, c, cos, sin, masks, st.con, 0, Mp)
        pred = cm.added_term(cm.predict(u, st.codes))  # (B, Mp, d)
        added_al = shift_blocks(pred, k, Tp)  # (B, Tp, d)
        last = pred[torch.arange(B, device=dev), (n_blocks - 1).clamp_min(0)]  # (B, d)
        st.pred = torch.where((n_blocks > 0)[:, None], last, torch.zeros_like(last))
    else:
        added_al = torch.zeros_like(h)
        st.pred = h.new_zeros(B, d)
    # aligned -> slot layout; padding slots get nothing
    back = (ar[None] - st.pad_t[:, None]).clamp_min(0)
    added = added_al.gather(1, back[..., None].expand(B, Tp, d)) * valid[..., None]
    in_partial = (ar[None] >= (n_blocks * k)[:, None]) & (ar[None] < torch.tensor(lengths, device=dev)[:, None])
    st.block_sum = (h_al * in_partial[..., None]).sum(dim=1)  # (B, d)
    return cm.combine(h, added)


@torch.no_grad()
def step(model, st: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row, tokens (B,); returns next-token logits (B, V)."""
    s = st.slot
    if s >= st.capacity:
        raise ValueError(f"decode state is full ({st.capacity} slots); prefill with a larger max_len")
    dev = tokens.device
    x = model.embed(tokens[:, None])  # (B, 1, d)
    cos, sin = rope((s - st.pad_t)[:, None], model.cfg, x.dtype)
    keys = torch.arange(s + 1, device=dev)
    valid = keys[None] >= st.pad_t[:, None]  # (B, s+1)
    masks = {w: attn_mask(keys[s:][None], keys[None], w, valid) for w in stack_windows(model.token_layers())}
    x = run_stack(model.encoder, x, cos, sin, masks, st.enc, s, s + 1)
    if model.concept is not None:
        x = _concept_step(model.concept, st, x)
    x = run_stack(model.decoder, x, cos, sin, masks, st.dec, s, s + 1)
    st.slot += 1
    return model.lm_head(model.final_norm(x))[:, 0]


def _concept_step(cm, st: DecodeState, h: torch.Tensor) -> torch.Tensor:
    """h (B, 1, d) of the new token -> decoder input z (B, 1, d)."""
    k, dev = cm.k, h.device
    st.block_sum = st.block_sum + h[:, 0]
    pos = [st.slot - p for p in st.pad]  # host positions of the new token
    done = [p % k == k - 1 for p in pos]
    if any(done):
        j = [p // k for p in pos]  # block index (done rows: the block just completed)
        pos_t = st.slot - st.pad_t  # (B,) the same on the device, without a host->device copy
        j_t, done_t = pos_t // k, (pos_t % k == k - 1)[:, None]
        c = (st.block_sum / k)[:, None]  # (B, 1, d) pooled block
        cos, sin = rope(cm.positions(j_t)[:, None], cm.cfg, h.dtype)
        keys = torch.arange(max(j) + 1, device=dev)
        masks = {w: attn_mask(j_t[:, None], keys[None], w) for w in stack_windows(cm.layers)}
        u = run_stack(cm.layers, c, cos, sin, masks, st.con, j_t, max(j) + 1)
        new = cm.added_term(cm.predict(u, st.codes))[:, 0]  # (B, d)
        st.pred = torch.where(done_t, new, st.pred)
        st.block_sum = st.block_sum.masked_fill(done_t, 0.0)
    return cm.combine(h, st.pred[:, None])
