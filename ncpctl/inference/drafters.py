"""Drafters for speculative decoding (speculative.py), behind one small interface.

A drafter follows the committed tokens of a batch (the same left-padded slot layout as the
target) and proposes K tokens a round with the distributions it drew them from:

* ``start(target, tokens, lengths, max_len)``: the prompts (B, Tp) were prefilled on ``target``
  (a ``speculative.Cursor``: its ``state`` holds the pads and the prompt's final-norm states);
* ``propose(x, K, params, gens, vocab_size)`` -> drafts (B, K) and q (B, K, V): the pending
  token x (B,) is committed, d_1..d_K follow it; q_i is what d_i was drawn from (greedy: one-hot);
* ``commit(keep)``: row b kept x, d_1 .. d_{m-1} with m = keep[b] (m <= K + 1; m = K + 1 also
  keeps d_K; m = 0: nothing, a row that stopped), and its next pending token is the round's m-th.
* ``max_tokens``: the most drafts it can propose a round (None: any K).
* ``attach(target_model)`` / ``detach()``: around each ``speculate`` call, ``attach`` before the
  prefill (a drafter that reads the target's hidden states hooks it there); no-ops by default.

``ModelDrafter``: any ncpctl checkpoint with the target's tokenizer, decoding on its own caches.
``BlockDraftRunner`` (block_drafter.py): the block-parallel drafter of NCP-ArchPreview Sec. 5.3,
which reads the target's hidden states and proposes K tokens in one forward.
``MtpDrafter``: the target's own MTP head (mtp.py): depth k at the last verified position
reads depth k-1's state there and the embedding of the token k ahead (the pending token, then
the drafts), so a head of depth D drafts up to D tokens per round at the cost of D single-layer
steps. Each depth keeps a KV cache over the slots; a depth-k entry at slot t is final once the
token at t + k is committed, and the entries after the last final one are recomputed each
round (k - 1 of them), so no rollback is needed.
"""

from __future__ import annotations

import torch

from ncpctl.model.core.layers import Context, KVCache, rope
from ncpctl.model.core.patterns import step_masks

from .speculative import Cursor, draw, probs


class Drafter:
    max_tokens: int | None = None

    def attach(self, target_model) -> None:
        """Before the target's prefill of a ``speculate`` call (a drafter that reads its states)."""

    def detach(self) -> None:
        """After the call."""

    def start(self, target: Cursor, tokens: torch.Tensor, lengths: list[int], max_len: int) -> None:
        raise NotImplementedError

    def propose(self, x: torch.Tensor, K: int, params, gens: list, vocab_size: int | None):
        raise NotImplementedError

    def commit(self, keep: list[int]) -> None:
        raise NotImplementedError


def _draw_rows(logits: torch.Tensor, params, gens: list, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, V) -> (one drawn token per row (B,), the distribution it came from (B, V))."""
    q = probs(logits if vocab_size is None else logits[:, :vocab_size], params)
    return torch.tensor([draw(q[b], params, g) for b, g in enumerate(gens)], device=logits.device), q


class ModelDrafter(Drafter):
    """An independent (smaller) model: K cached steps a round, each row rolled back to what it kept."""

    def __init__(self, model):
        self.model = model

    def start(self, target, tokens, lengths, max_len) -> None:
        self.cur = Cursor(self.model, tokens, lengths, max_len)

    def propose(self, x, K, params, gens, vocab_size):
        logits = self.cur.feed(x[:, None])[:, 0]
        ds, qs = [], []
        for i in range(K):
            d, q = _draw_rows(logits, params, gens, vocab_size)
            ds.append(d)
            qs.append(q)
            if i < K - 1:
                logits = self.cur.feed(d[:, None])[:, 0]
        self.k, self.last_draft = K, ds[-1][:, None]
        return torch.stack(ds, 1), torch.stack(qs, 1)

    def commit(self, keep: list[int]) -> None:
        # fed this round: x, d_1 .. d_{K-1}; a row that kept all K drafts also needs d_K
        self.cur.commit([min(k, self.k) for k in keep])
        full = [k == self.k + 1 for k in keep]
        if any(full):
            self.cur.feed(self.last_draft)
            self.cur.commit([int(f) for f in full])


class MtpDrafter(Drafter):
    """The target's MTP head as its own drafter (depth k drafts token t + k + 1)."""

    def __init__(self, model):
        if model.mtp is None:
            raise ValueError("the model has no MTP head (model.mtp_depth)")
        self.model = model
        self.max_tokens = len(model.mtp.depths)

    def start(self, target, tokens, lengths, max_len) -> None:
        m, st = self.model, target.state
        B, Tp = tokens.shape
        D = self.max_tokens
        cap = max_len + D + 2
        self.target, self.pad_t = target, st.pad_t
        self.tok = tokens.new_zeros(B, cap + D + 1)  # committed tokens by slot, then x and the drafts
        self.tok[:, :Tp] = tokens
        h = st.hidden  # (B, Tp, d) the prompt's final-norm states
        self.H = [h.new_zeros(B, cap, h.shape[-1]) for _ in range(D + 1)]  # H[k]: depth k's states by slot
        self.H[0][:, :Tp] = h
        cfg = m.cfg
        self.caches = [KVCache(B, cfg.n_kv_heads, cfg.head_dim, h.device, h.dtype, cap) for _ in range(D)]
        self.first = [[0] * B for _ in range(D + 1)]  # depth k, row b: the first slot whose entry is not final
        self.last = [Tp - 1] * B  # each row's last slot the target has fed

    def propose(self, x, K, params, gens, vocab_size):
        m, L = self.model, self.last  # L[b]: row b's last fed slot
        dev = x.device
        rows, L_t = torch.arange(len(L), device=dev), torch.tensor(L, device=dev)
        self.tok[rows, L_t + 1] = x
        top = max(L)
        keys = torch.arange(top + 1, device=dev)
        valid = keys[None] >= self.pad_t[:, None]  # (B, top+1)
        ds, qs = [], []
        for k in range(1, K + 1):
            # from the first slot not final in some row to the furthest row's last (a row's slots
            # past its own last are junk it never reads: later than its queries, recomputed later)
            f = min(self.first[k])
            slots = torch.arange(f, top + 1, device=dev)
            pos = slots[None] - self.pad_t[:, None]  # (B, n) rows' own positions (padding: negative)
            # the token k ahead of each slot (positions past the window: junk slots, never read)
            emb = m.embed_tokens(self.tok[:, slots + k], pos.clamp(0, m.cfg.max_seq_len - 1))
            cos, sin = rope(pos.clamp_min(0), m.cfg, emb.dtype)
            masks = step_masks([None], pos, keys[None] - self.pad_t[:, None], valid)
            ctx = Context(cos, sin, masks, [self.caches[k - 1]], at=f, length=top + 1)
            out = m.mtp.depths[k - 1](self.H[k - 1][:, f : top + 1], emb, ctx)  # (B, n, d)
            self.H[k][:, f : top + 1] = out
            last = out[rows, L_t - f][:, None]  # (B, 1, d) each row's last fed slot
            d, q = _draw_rows(m.head(m.final_norm(last))[:, 0], params, gens, vocab_size)
            self.tok[rows, L_t + 1 + k] = d
            ds.append(d)
            qs.append(q)
            # slot t is final for depth k once the token at t + k is committed (x sits at L + 1)
            self.first[k] = [n + 2 - k for n in L]
        return torch.stack(ds, 1), torch.stack(qs, 1)

    def commit(self, keep: list[int]) -> None:
        hidden = self.target.state.hidden  # (B, K+1, d) the target's states of this round's tokens
        for b, n in enumerate(keep):
            self.H[0][b, self.last[b] + 1 : self.last[b] + 1 + n] = hidden[b, :n]
        self.last = [n + k for n, k in zip(self.last, keep)]


MTP = "mtp"  # --draft mtp: the target's own MTP head


def load_speculative(loaded, draft: str, k: int):
    """``ncpctl generate --draft DRAFT --draft-tokens K`` for a ``LoadedModel`` target: a
    ``speculative.Speculative``, or a one-line ``UserError`` (K < 1, a target that cannot verify
    drafts, no MTP head, a drafter with another tokenizer or vocabulary or a shorter window).
    Returns it and a description of the drafter for the output: ``draft_tokens`` is the K it
    drafts a round, at most what the drafter proposes (an MTP head its depth, a block drafter its
    own K); ``draft_tokens_requested`` is there when that cut K."""
    spec, info = _load(loaded, draft, k)
    most = spec.drafter.max_tokens
    if most is not None and most < k:
        spec.k = most
        info["draft_tokens_requested"] = k
    return spec, {**info, "draft_tokens": spec.k}


def _load(loaded, draft: str, k: int):
    """``load_speculative`` before the cut of K."""
    from ncpctl.checkpoint import load_model
    from ncpctl.errors import UserError

    from .speculative import Speculative

    if k < 1:
        raise UserError(f"--draft-tokens must be >= 1, got {k}")
    refuse = _no_verify(loaded)
    if refuse:
        raise UserError(f"{loaded.path}: speculative decoding needs {refuse}")
    if draft == MTP:
        if loaded.model.mtp is None:
            raise UserError(f"{loaded.path} has no MTP head (model.mtp_depth is null): --draft mtp needs one")
        return Speculative(MtpDrafter(loaded.model), k), {"draft": MTP, "mtp_depth": len(loaded.model.mtp.depths)}
    from ncpctl.checkpoint import read_meta, resolve

    meta = read_meta(resolve(draft))
    if "drafter" in meta:  # a block-parallel drafter (``ncpctl train-drafter``): it reads the target's states
        from .block_drafter import load_block_drafter

        return load_block_drafter(loaded, resolve(draft), meta, k)
    d = load_model(draft)
    why = _no_verify(d)
    if why:
        raise UserError(f"drafter {d.path}: drafting needs {why}")
    if d.config.vocab_size != loaded.config.vocab_size or d.tokenizer is None or loaded.tokenizer is None \
            or d.tokenizer.get_vocab(with_added_tokens=True) != loaded.tokenizer.get_vocab(with_added_tokens=True):
        raise UserError(f"drafter {d.path} has another tokenizer or vocabulary than {loaded.path}: a drafter "
                        "must share the target's tokenizer")
    if d.config.max_seq_len < loaded.config.max_seq_len:
        raise UserError(f"drafter {d.path} has a shorter window ({d.config.max_seq_len}) than {loaded.path} "
                        f"({loaded.config.max_seq_len})")
    d.model.to(dtype=loaded.model.embed.weight.dtype, device=loaded.model.embed.weight.device)
    return Speculative(ModelDrafter(d.model), k), {"draft": str(d.path)}


def _no_verify(loaded) -> str | None:
    """What a model lacks to verify or draft tokens on KV caches (None: nothing)."""
    ob = loaded.model.objective
    if ob.block_sampling or not ob.causal:
        return f"next-token decoding on KV caches; objective {loaded.config.objective} samples otherwise"
    return None
