"""Drafters for speculative decoding (speculative.py), behind one small interface.

A drafter follows the committed tokens of a batch (the same left-padded slot layout as the
target) and proposes K tokens a round with the distributions it drew them from:

* ``start(target, tokens, lengths, max_len)``: the prompts (B, Tp) were prefilled on ``target``
  (a ``speculative.Cursor``: its ``state`` holds the pads and the prompt's final-norm states);
* ``propose(x, K, params, gens, vocab_size)`` -> drafts (B, K) and q (B, K, V): the pending
  token x (B,) is committed, d_1..d_K follow it; q_i is what d_i was drawn from (greedy: one-hot);
* ``commit(m)``: the round kept x, d_1 .. d_{m-1} (m <= K + 1; m = K + 1 also keeps d_K),
  and the next pending token is the round's m-th.
* ``max_tokens``: the most drafts it can propose a round (None: any K).

``ModelDrafter``: any ncpctl checkpoint with the target's tokenizer, decoding on its own caches.
``MtpDrafter``: the target's own MTP head (mtp.py): depth k at the last verified position
reads depth k-1's state there and the embedding of the token k ahead (the pending token, then
the drafts), so a head of depth D drafts up to D tokens per round at the cost of D single-layer
steps. Each depth keeps a KV cache over the slots; a depth-k entry at slot t is final once the
token at t + k is committed, and the entries after the last final one are recomputed each
round (k - 1 of them), so no rollback is needed.
"""

from __future__ import annotations

import torch

from ncpctl.model.layers import Context, KVCache, rope
from ncpctl.model.patterns import step_masks

from .speculative import Cursor, draw, probs


class Drafter:
    max_tokens: int | None = None

    def start(self, target: Cursor, tokens: torch.Tensor, lengths: list[int], max_len: int) -> None:
        raise NotImplementedError

    def propose(self, x: torch.Tensor, K: int, params, gens: list, vocab_size: int | None):
        raise NotImplementedError

    def commit(self, m: int) -> None:
        raise NotImplementedError


def _draw_rows(logits: torch.Tensor, params, gens: list, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, V) -> (one drawn token per row (B,), the distribution it came from (B, V))."""
    q = probs(logits if vocab_size is None else logits[:, :vocab_size], params)
    return torch.tensor([draw(q[b], params, g) for b, g in enumerate(gens)], device=logits.device), q


class ModelDrafter(Drafter):
    """An independent (smaller) model: K cached steps a round, rolled back to what was kept."""

    def __init__(self, model):
        self.model = model

    def start(self, target, tokens, lengths, max_len) -> None:
        self.cur = Cursor(self.model, tokens, lengths, max_len)
        self.extra: torch.Tensor | None = None  # (B, 1) a kept draft not fed yet (all K were accepted)

    def propose(self, x, K, params, gens, vocab_size):
        chunk = x[:, None] if self.extra is None else torch.cat([self.extra, x[:, None]], 1)  # (B, 1|2)
        self.extra = None
        logits = self.cur.feed(chunk)[:, -1]
        ds, qs = [], []
        for i in range(K):
            d, q = _draw_rows(logits, params, gens, vocab_size)
            ds.append(d)
            qs.append(q)
            if i < K - 1:
                logits = self.cur.feed(d[:, None])[:, 0]
        self.n_chunk, self.k, self.last_draft = chunk.shape[1], K, ds[-1][:, None]
        return torch.stack(ds, 1), torch.stack(qs, 1)

    def commit(self, m: int) -> None:
        # fed this round: the chunk (ending with x), then d_1 .. d_{K-1}
        if m <= self.k:
            self.cur.commit(self.n_chunk - 1 + m)
        else:  # everything fed was kept, and d_K too: feed it with the next pending token
            self.cur.commit(self.cur.fed)
            self.extra = self.last_draft


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
        cap = max_len + 1
        self.target, self.pad_t = target, st.pad_t
        self.tok = tokens.new_zeros(B, cap + D + 1)  # committed tokens by slot, then x and the drafts
        self.tok[:, :Tp] = tokens
        h = st.hidden  # (B, Tp, d) the prompt's final-norm states
        self.H = [h.new_zeros(B, cap, h.shape[-1]) for _ in range(D + 1)]  # H[k]: depth k's states by slot
        self.H[0][:, :Tp] = h
        cfg = m.cfg
        self.caches = [KVCache(B, cfg.n_kv_heads, cfg.head_dim, h.device, h.dtype, cap) for _ in range(D)]
        self.first = [0] * (D + 1)  # depth k: the first slot whose entry is not final
        self.last = Tp - 1  # the last slot the target has fed

    def propose(self, x, K, params, gens, vocab_size):
        m, L = self.model, self.last
        self.tok[:, L + 1] = x
        keys = torch.arange(L + 1, device=x.device)
        valid = keys[None] >= self.pad_t[:, None]  # (B, L+1)
        ds, qs = [], []
        for k in range(1, K + 1):
            f = self.first[k]
            slots = torch.arange(f, L + 1, device=x.device)
            pos = slots[None] - self.pad_t[:, None]  # (B, n) rows' own positions (padding: negative)
            emb = m.embed_tokens(self.tok[:, slots + k], pos.clamp_min(0))  # the token k ahead of each slot
            cos, sin = rope(pos.clamp_min(0), m.cfg, emb.dtype)
            masks = step_masks([None], pos, keys[None] - self.pad_t[:, None], valid)
            ctx = Context(cos, sin, masks, [self.caches[k - 1]], at=f, length=L + 1)
            out = m.mtp.depths[k - 1](self.H[k - 1][:, f : L + 1], emb, ctx)  # (B, n, d)
            self.H[k][:, f : L + 1] = out
            d, q = _draw_rows(m.head(m.final_norm(out[:, -1:]))[:, 0], params, gens, vocab_size)
            self.tok[:, L + 1 + k] = d
            ds.append(d)
            qs.append(q)
            # slot t is final for depth k once the token at t + k is committed (x sits at L + 1)
            self.first[k] = L + 2 - k
        return torch.stack(ds, 1), torch.stack(qs, 1)

    def commit(self, m: int) -> None:
        L = self.last
        self.H[0][:, L + 1 : L + 1 + m] = self.target.state.hidden[:, :m]  # the target's states of the kept tokens
        self.last = L + m


MTP = "mtp"  # --draft mtp: the target's own MTP head


def load_speculative(loaded, draft: str, k: int):
    """``ncpctl generate --draft DRAFT --draft-tokens K`` for a ``LoadedModel`` target: a
    ``speculative.Speculative``, or a one-line ``UserError`` (K < 1, a target that cannot verify
    drafts, no MTP head, a drafter with another tokenizer or vocabulary or a shorter window).
    Returns it and a description of the drafter for the output."""
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
