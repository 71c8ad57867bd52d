"""Incremental decoding with KV caches (spec section 5); exact vs the full forward.

Batch layout: prompts are LEFT-padded onto one shared slot axis. Row b has ``pad[b]``
padding slots, then its tokens: the token in slot s has position p = s - pad[b]. All rows
advance one slot per step, so the token-layer caches (encoder, decoder) share one write
index ``state.slot``; RoPE uses the per-row positions and padding keys are masked out, so
every row computes what it would alone.

The concept path runs per row: the segmenter's device-side update (segment.py) says which
rows closed a segment at this token, with the pooled concept and its index j. The concept
cache is indexed by each row's own j and written with a per-row index. When the segmenter
knows on the host which rows closed (fixed blocks: from the pads; learned boundaries: from
its one sync per step), the concept step runs on those rows only (``KVCache.rows``) and is
skipped when none did; otherwise every row computes it, and rows that closed nothing write a
throw-away entry at their next, not yet valid, index (overwritten when that concept closes)
and keep their coupling state.

Per row the state holds (spec 5): encoder/decoder/concept KV caches, the segmenter's state
(fixed blocks: the sum of h over the open block), the coupling's (addition: the current
added term, zeros before the first concept closes) and the interventions of the prefill.
The codebook is computed once at prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ncpctl.model.core.interventions import decoder_input_addition, edit_code_weights, readout_addition, residual_additions
from ncpctl.model.core.layers import Context, KVCache, attn_mask, rope
from ncpctl.model.core.patterns import step_masks


@dataclass
class DecodeState:
    pad: list[int]  # host: padding slots per row
    pad_t: torch.Tensor  # (B,) the same on the device
    slot: int  # next slot to write, shared by all rows (with ``behind``: the furthest row's)
    capacity: int | None  # slots the token caches hold (None: they grow)
    enc: list[KVCache]
    dec: list[KVCache]
    con: list[KVCache]
    codes: torch.Tensor | None = None  # (S, N, ds)
    seg: dict = field(default_factory=dict)  # the segmenter's per-row state, (B, ...) tensors
    cpl: dict = field(default_factory=dict)  # the coupling's per-row state, (B, ...) tensors
    crc: dict = field(default_factory=dict)  # concept-decoder CRC: each row's latest concept depths (B, C+1, d)
    interventions: list = field(default_factory=list)
    hidden: torch.Tensor | None = None  # (B, n, d) final-norm states of the latest call (prefill or step)
    # row b's next slot is slot - behind[b] (None: every row's is slot). Speculative decoding keeps
    # a different number of tokens per row; a row's slots past its own are stale and never visible
    # (their positions are later than any of its queries), and are written again as it advances
    behind: list[int] | None = None

    @property
    def row_slots(self) -> list[int]:
        """Each row's next slot to write."""
        return [self.slot] * len(self.pad) if self.behind is None else [self.slot - b for b in self.behind]

    @property
    def lengths(self) -> list[int]:
        """Tokens seen so far per row."""
        return [s - p for s, p in zip(self.row_slots, self.pad)]

    @property
    def pred(self) -> torch.Tensor | None:
        """(B, d) the concept term the addition coupling adds to the next token."""
        return self.cpl.get("pred")

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (B,) in that order (beam search, after each step)."""
        idx = rows.tolist()
        self.pad = [self.pad[i] for i in idx]
        if self.behind is not None:
            self.behind = [self.behind[i] for i in idx]
        self.pad_t = self.pad_t[rows]
        for kv in (*self.enc, *self.dec, *self.con):
            kv.reorder(rows)
        for d in (self.seg, self.cpl, self.crc):
            for k, v in d.items():
                d[k] = v[rows]


def _caches(cfg, n: int, batch: int, capacity: int | None, device, dtype) -> list[KVCache]:
    """KV caches of n layers whose blocks ``cfg`` describes (the token or the concept stack's)."""
    return [KVCache(batch, cfg.n_kv_heads, cfg.head_dim, device, dtype, capacity) for _ in range(n)]


def _contexts(model, ivs, ctx: Context, positions: torch.Tensor, like: torch.Tensor, st: DecodeState):
    """Encoder and decoder contexts of one call: shared tables and masks, own caches and additions."""
    E, D = len(model.encoder), len(model.decoder)
    enc = ctx.with_(caches=st.enc, adds=residual_additions(ivs, "encoder", E, positions, like) if ivs else {})
    dec = ctx.with_(caches=st.dec, adds=residual_additions(ivs, "decoder", D, positions, like) if ivs else {})
    return enc, dec


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, lengths, max_len: int | None, ivs: list) -> tuple[torch.Tensor, DecodeState]:
    """Run left-padded prompts tokens (B, Tp) (row b's real tokens are its last lengths[b]
    slots) and allocate caches for ``max_len`` slots in all (None: grown as needed). Returns
    logits (B, Tp, V) (padding slots hold junk) and the state for ``step``."""
    cfg = model.cfg
    B, Tp = tokens.shape
    dev = tokens.device
    lengths = [int(n) for n in lengths]
    if len(lengths) != B or min(lengths) < 1 or max(lengths) > Tp:
        raise ValueError(f"lengths must be {B} values in [1, {Tp}], got {lengths}")
    if max_len is not None and max_len < Tp:
        raise ValueError(f"max_len={max_len} is shorter than the prompt ({Tp} slots)")
    pad = [Tp - n for n in lengths]
    dtype = model.embed.weight.dtype
    cm = model.concept
    n_con = len(cm.layers) if cm is not None else 0
    con_cap = None if max_len is None or cm is None else cm.segmenter.max_concepts(max_len) + 1
    st = DecodeState(
        pad=pad, pad_t=torch.tensor(pad, device=dev), slot=Tp, capacity=max_len,
        enc=_caches(cfg, len(model.encoder), B, max_len, dev, dtype),
        dec=_caches(cfg, len(model.decoder), B, max_len, dev, dtype),
        con=_caches(cfg.concept_cfg, n_con, B, con_cap, dev, dtype), interventions=ivs,
    )
    slots = torch.arange(Tp, device=dev)
    valid = slots[None] >= st.pad_t[:, None]  # (B, Tp) real tokens
    positions = (slots[None] - st.pad_t[:, None]).clamp_min(0)  # (B, Tp)
    x = model.embed_tokens(tokens, positions)  # (B, Tp, d)
    cos, sin = rope(positions, cfg, x.dtype, limit=Tp)
    # each layer's declared pattern over the rows' own positions (padding: negative, never visible)
    slot_pos = slots[None] - st.pad_t[:, None]  # (B, Tp)
    masks = step_masks(model.token_patterns, slot_pos, slot_pos, valid)
    enc, dec = _contexts(model, ivs, Context(cos, sin, masks, at=0, length=Tp), positions, x, st)
    h, depths = _encode(model, x, enc)
    z, concept_depths = _concept_prefill(model, st, h, lengths, ivs, depths) if cm is not None else (h, None)
    z = decoder_input_addition(ivs, z, positions)
    hN = st.hidden = model.decode(z, _decoder_context(model, dec, st, positions, depths, concept_depths))
    h_bar = readout_addition(ivs, model.readout(hN)[0], positions)  # the full forward's head path
    return model.head(h_bar), st


def _encode(model, x: torch.Tensor, ctx: Context):
    """(h, the encoder's depths when a cross-module residual reads them, else None)."""
    if model._keeps_encoder_depths(False):
        return model.encode(x, ctx, states=True)
    return model.encode(x, ctx), None


def _decoder_context(model, dec: Context, st: DecodeState, positions, depths, concept_depths) -> Context:
    """The coupling's decoder context (its memory) and the decoder's CRC hook, for the slots at
    ``positions`` (the prefill's (B, Tp) or a step's (B, 1))."""
    if model.concept is not None:
        dec = model.concept.coupling.decode_context(dec, st.cpl, positions)
    return model.decoder_crc(dec, depths, concept_depths)


def _concept_prefill(model, st: DecodeState, h: torch.Tensor, lengths: list[int], ivs: list,
                     depths: list | None) -> tuple[torch.Tensor, list | None]:
    """Concept path over the prompts h (B, Tp, d) (slot layout) -> decoder input z (B, Tp, d)
    and, for a concept-decoder CRC, the concept depths spread to the slots; fills the concept
    cache and the segmenter's, coupling's and CRC's states. With an encoder-concept CRC every
    encoder depth is pooled with h (one (B, Tp, (E+1) d) tensor through the segmenter)."""
    cm = model.concept
    pooled_depths = depths if model._crc_has("encoder-concept") else None
    B, Tp, d = h.shape
    dev = h.device
    ar = torch.arange(Tp, device=dev)
    h_in = h if pooled_depths is None else torch.cat(pooled_depths, dim=-1)
    # slot layout -> aligned layout (index = position, rows right-padded)
    src = (ar[None] + st.pad_t[:, None]).clamp_max(Tp - 1)
    h_al = h_in.gather(1, src[..., None].expand(B, Tp, h_in.shape[-1]))
    lengths_t = torch.tensor(lengths, device=dev)
    st.seg = cm.segmenter.decode_init(B, h_in.shape[-1], dev, h.dtype)
    seg = cm.segmenter.decode_prefill(st.seg, h_al, lengths_t, lengths)
    seg.lengths = lengths_t
    pooled = None
    if pooled_depths is not None:
        pooled = list(seg.concepts.chunk(len(pooled_depths), dim=-1))
        seg.concepts, h_al = pooled[-1], h_al[..., -d:]
    st.codes = cm.codebook()
    M = seg.concepts.shape[1]
    pred, cdepths = None, None
    want = model._crc_has("concept-decoder")
    if M > 0:
        # Right padding: a row's junk concepts come after its real ones, so the causal mask
        # keeps them out of every real concept's output.
        ctx = cm.context(seg.positions, h.dtype, limit=h.shape[1]).with_(caches=st.con, at=0, length=M)
        if pooled is not None:
            ctx = model.crc.attach(ctx, [("encoder-concept", pooled)])
        c_in = cm.lift(seg.concepts)  # (B, M, d_c)
        u, cdepths = cm.layers(c_in, ctx, states=True) if want else (cm.layers(c_in, ctx), None)
        w = edit_code_weights(ivs, cm.code_weights(u), torch.arange(M, device=dev)[None])
        pred = cm.mix(w, st.codes)  # (B, M, d)
    z_al = cm.coupling(h_al, pred, seg, cm.segmenter)  # (B, Tp, d)
    st.cpl = cm.coupling.decode_state(pred, seg, cm.segmenter, h)
    back = (ar[None] - st.pad_t[:, None]).clamp_min(0)  # aligned -> slot layout (padding: junk)
    to_slots = lambda t: t.gather(1, back[..., None].expand(B, Tp, d))  # noqa: E731
    if not want:
        return to_slots(z_al), None
    K = cm.layers.n_depths
    if cdepths is None:  # no concept closed yet in any prompt: zero sources, as the full forward
        st.crc["concept"] = h.new_zeros(B, K, d)
        return to_slots(z_al), [torch.zeros_like(h)] * K
    latest = torch.stack(cdepths, 1)[torch.arange(B, device=dev), :, (seg.n_closed - 1).clamp_min(0)]  # (B, K, d)
    st.crc["concept"] = latest * (seg.n_closed > 0)[:, None, None].to(h.dtype)
    return to_slots(z_al), [to_slots(cm.segmenter.spread(seg, c, Tp)) for c in cdepths]


@torch.no_grad()
def step(model, st: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row, tokens (B,); returns next-token logits (B, V)."""
    return step_many(model, st, tokens[:, None])[:, 0]


def snapshot(st: DecodeState) -> dict:
    """Copies of the per-row state that a step changes besides the KV caches (segmenter, coupling,
    CRC): with ``st.slot`` they are all a rollback needs (cache entries past the slot, or past a
    row's closed concepts, are never read before they are written again)."""
    return {name: {k: v.clone() for k, v in getattr(st, name).items()} for name in ("seg", "cpl", "crc")}


def restore(st: DecodeState, snaps: list[dict], slots: list[int]) -> None:
    """Roll row b of ``st`` back to ``snaps[b]`` (a ``snapshot`` of the whole batch, taken when
    the row's next slot was ``slots[b]``)."""
    for name in ("seg", "cpl", "crc"):
        d = {}
        for k in snaps[0][name]:
            parts = [snap[name][k][b] for b, snap in enumerate(snaps)]
            if len({p.shape for p in parts}) > 1:  # a coupling's concept keys grew between the snapshots
                big = [max(sz) for sz in zip(*(p.shape for p in parts))]
                parts = [torch.nn.functional.pad(p, [x for i in reversed(range(p.dim()))
                                                     for x in (0, big[i] - p.shape[i])]) for p in parts]
            d[k] = torch.stack(parts)
        setattr(st, name, d)
    st.slot = max(slots)
    st.behind = None if min(slots) == st.slot else [st.slot - s for s in slots]


@torch.no_grad()
def step_many(model, st: DecodeState, tokens: torch.Tensor, snapshots: list | None = None) -> torch.Tensor:
    """Feed n tokens per row, tokens (B, n), in one cached forward of the token stacks; returns
    logits (B, n, V), entry i predicting the token after tokens[:, i] (what n ``step`` calls
    give). The concept path runs token by token (a concept may close at any of the n tokens,
    and the next token's decoder input must see it); ``snapshots``, if given, receives the
    ``snapshot`` after each token (speculative decoding rolls back to one of them).
    ``st.hidden`` keeps the final-norm states (B, n, d) (an MTP drafter reads them)."""
    s, n = st.slot, tokens.shape[1]
    if n > 1 and _context_per_step(model):  # its decoder context reads the state after the last token only
        outs, hidden = [], []
        for i in range(n):
            outs.append(step_many(model, st, tokens[:, i : i + 1], snapshots))
            hidden.append(st.hidden)
        st.hidden = torch.cat(hidden, 1)
        return torch.cat(outs, 1)
    if st.capacity is not None and s + n > st.capacity:
        raise ValueError(f"decode state is full ({st.capacity} slots); prefill with a larger max_len")
    dev = tokens.device
    rows = st.row_slots  # host: each row's first new slot
    start = torch.tensor(rows, device=dev) if st.behind is not None else torch.full_like(st.pad_t, s)
    pos = (start[:, None] + torch.arange(n, device=dev)[None]) - st.pad_t[:, None]  # (B, n) their positions
    # a speculative round may feed a finished row's throw-away tokens past the window: learned
    # position tables (gpt2) end there, and those tokens' outputs are never used
    x = model.embed_tokens(tokens, pos.clamp_max(model.cfg.max_seq_len - 1))  # (B, n, d)
    cos, sin = rope(pos, model.cfg, x.dtype, limit=s + n)  # positions are below their slots
    keys = torch.arange(s + n, device=dev)
    valid = keys[None] >= st.pad_t[:, None]  # (B, s+n)
    masks = step_masks(model.token_patterns, pos, keys[None] - st.pad_t[:, None], valid)
    ivs = st.interventions
    at = s if st.behind is None else start  # int: one write index for all rows; (B,): each row's own
    enc, dec = _contexts(model, ivs, Context(cos, sin, masks, at=at, length=s + n), pos, x, st)
    h, depths = _encode(model, x, enc)
    z, concept_depths = h, None
    if model.concept is not None:
        zs, cds = [], []
        for i in range(n):  # one concept step per token: (B, 1, d) each
            zi, cdi = _concept_step(model, st, h[:, i : i + 1], pos[:, i], [r + i - p for r, p in zip(rows, st.pad)],
                                    ivs, None if depths is None else [t[:, i : i + 1] for t in depths])
            zs.append(zi)
            cds.append(cdi)
            if snapshots is not None:
                snapshots.append(snapshot(st))
        z = torch.cat(zs, 1)  # (B, n, d)
        if cds[0] is not None:
            concept_depths = [torch.cat(c, 1) for c in zip(*cds)]
    elif snapshots is not None:
        snapshots += [snapshot(st)] * n
    z = decoder_input_addition(ivs, z, pos)
    dec = _decoder_context(model, dec, st, pos, depths, concept_depths)
    st.slot = s + n
    st.hidden = model.decode(z, dec)  # (B, n, d)
    return model.head(readout_addition(ivs, model.readout(st.hidden)[0], pos))


def _context_per_step(model) -> bool:
    """Whether the coupling builds the decoder's context from its decoding state (a memory to attend
    to, ``Coupling.decode_context``): that context is right for one new token at a time."""
    from ncpctl.model.core.coupling import Coupling

    cm = model.concept
    return cm is not None and type(cm.coupling).decode_context is not Coupling.decode_context


def _concept_step(model, st: DecodeState, h: torch.Tensor, pos: torch.Tensor, pos_host: list[int] | None, ivs: list,
                  depths: list | None) -> tuple[torch.Tensor, list | None]:
    """h (B, 1, d) of the new token at positions ``pos`` (B,) (``pos_host``: the same on the host;
    None in the static step, decode_static.py: every row steps over the whole concept cache, the
    RoPE table up to the token capacity) -> decoder input z (B, 1, d) and, for a concept-decoder
    CRC, each row's latest concept depths as K tensors (B, 1, d)."""
    cm = model.concept
    pooled_depths = depths if model._crc_has("encoder-concept") else None
    h_in = h[:, 0] if pooled_depths is None else torch.cat(pooled_depths, dim=-1)[:, 0]
    closing = cm.segmenter.decode_step(st.seg, h_in, pos, pos_host)
    if closing.length is None:  # static: the concept cache's capacity bounds it (prefill allocated it)
        closing = replace(closing, length=cm.segmenter.max_concepts(st.capacity) + 1)
    limit = st.capacity if pos_host is None else max(pos_host) + 1  # positions closed by now are below it
    want = model._crc_has("concept-decoder")
    if closing.any is not False:  # some row may have closed a concept: one concept step
        B = h.shape[0]
        # Only the rows that closed a concept when the segmenter knows them (the others' results
        # would be thrown away): at small batch on a CPU the concept layers are compute-bound,
        # and with learned boundaries a few rows of a batch close at each step.
        sub = closing.rows is not None and len(closing.rows) < B
        # the closing rows in order, from the device mask (a host list copied over would be a second
        # sync per step on a GPU): a stable sort puts the True rows first, their count is known here
        rows = torch.argsort((~closing.closed).to(torch.int8), stable=True)[:len(closing.rows)] if sub else None
        pick = (lambda t: t[rows]) if sub else (lambda t: t)  # noqa: E731
        j, n = pick(closing.index), closing.length
        concept = pick(closing.concept)
        pooled = None if pooled_depths is None else [c[:, None] for c in concept.chunk(len(pooled_depths), -1)]
        c_in = cm.lift(concept[:, None] if pooled is None else pooled[-1])  # (R, 1, d_c)
        cos, sin = rope(pick(closing.position)[:, None], cm.ccfg, h.dtype, limit=limit)
        keys = torch.arange(n, device=h.device)
        masks = {w: attn_mask(j[:, None], keys[None], w) for w in cm.layers.windows}
        caches = [c.rows(rows) for c in st.con] if sub else st.con
        ctx = Context(cos, sin, masks, caches, at=j, length=n)
        if pooled is not None:
            ctx = model.crc.attach(ctx, [("encoder-concept", pooled)])
        u, cdepths = cm.layers(c_in, ctx, states=True) if want else (cm.layers(c_in, ctx), None)
        w = cm.code_weights(u)  # (R, 1, S, N)
        if sub:  # back to all B rows (the others' entries are never read: closing.closed masks them)
            w = w.new_zeros(B, *w.shape[1:]).index_copy(0, rows, w)
            if cdepths is not None:
                cdepths = [c.new_zeros(B, *c.shape[1:]).index_copy(0, rows, c) for c in cdepths]
        w = edit_code_weights(ivs, w, closing.index[:, None])  # per-row edits see all B rows
        cm.coupling.decode_update(st.cpl, closing, cm.mix(w, st.codes)[:, 0])
        if want:
            st.crc["concept"] = torch.where(closing.closed[:, None, None], torch.cat(cdepths, 1), st.crc["concept"])
    z = cm.coupling.decode_input(h, st.cpl)
    return z, (list(st.crc["concept"].split(1, dim=1)) if want else None)
