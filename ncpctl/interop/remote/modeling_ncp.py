"""NCP / ConceptLM causal LM for HF transformers: self-contained (torch + transformers).

Written by ``ncpctl export``; the same computation as ncpctl's ``NCPModel`` (spec:
ncp-model.md sections 1-5), checked by the exporter on a probe batch. Data flow:

    tokens -> embed -> encoder (E layers) -> h                      (B, T, d)
    h -> mean-pool blocks of k -> concept transformer (C layers)    (B, M, d), M = T // k
      -> S heads x N codes -> pred (mix of codebook vectors)       (B, M, d)
    z[p] = h[p] + pred[(p+1)//k - 1] (0 for p < k-1)                (B, T, d)
    z -> decoder (D layers) -> final norm -> LM head -> logits      (B, T, V)

Padding: concept blocks are anchored at each row's first real token, so an
``attention_mask`` may pad on the left (batched ``generate``): row b's real tokens then get
positions 0, 1, ... and padding keys are masked out, so every row computes what it would
alone. Right padding is allowed without a cache (causal attention keeps it out of the real
positions); padding inside a row is rejected.

Incremental decoding (spec section 5) mirrors ncpctl's ``ncpctl/model/decode.py``: with
``use_cache`` the forward returns an ``NCPCache`` as ``cache`` and each later forward feeds one
new token per row. It holds the encoder/decoder/concept-layer KV caches, the sum of h over
each row's unfinished block and the current pred. ``generate`` only carries that object
from one forward to the next (``_supports_default_dynamic_cache`` is False, as for recurrent
models: the concept path's state is not per-layer keys/values that a transformers
``Cache`` could hold). Without a cache (``use_cache=False``) every forward recomputes the
whole sequence; unpadded, that is the plain full forward below.

Batch layout of the cache: left-padded prompts share one slot axis; row b has ``pad[b]``
padding slots, so the token in slot s has position p = s - pad[b]. All rows advance one
slot per step (one shared write index for the token-layer caches). The concept path runs
per row: row b completes a block when p % k == k-1, at a different step than other rows;
its concept cache is indexed by its own block number j = p // k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ncp import NCPConfig


class _Cfg:
    """Attribute view of the ``ncp`` + ``derived`` dicts."""

    def __init__(self, config: NCPConfig):
        self.__dict__.update(config.ncp)
        self.__dict__.update(config.derived)
        self.concept = dict(config.ncp.get("concept") or {})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(c: _Cfg, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=c.norm_eps) if c.backbone == "neox" else RMSNorm(dim, c.norm_eps)


def layer_window(c: _Cfg, number: int):
    if c.sliding_window is None or number % c.full_attn_every == 0:
        return None
    return c.sliding_window


def rope(positions, c: _Cfg, dtype):
    rd = c.rotary_dim
    inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, rd, 2, dtype=torch.float, device=positions.device) / rd))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if xp.shape[-1] == 0 else torch.cat((out, xp), dim=-1)


def causal_masks(windows, T: int, device):
    out = {}
    for w in windows:
        if w is None or T <= w:
            out[w] = None
        else:
            pos = torch.arange(T, device=device)
            diff = pos[:, None] - pos[None, :]
            out[w] = ((diff >= 0) & (diff < w))[None, None]
    return out


def attn_mask(q_pos, k_pos, window, k_valid=None):
    """Boolean SDPA mask (B|1, 1, Tq, Tk), True = attend, for the padded and cached paths.

    Key j is visible from query i iff 0 <= pos_i - pos_j < window and the key is valid (not
    padding). A query always sees itself, so a padding query never has an empty row (NaN).
    """
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # (B|1, Tq, Tk)
    m = diff >= 0
    if window is not None:
        m = m & (diff < window)
    if k_valid is not None:
        m = m & (k_valid[:, None, :] | (diff == 0))
    return m[:, None]


class KVCache:
    """Keys/values of one attention layer, (B, Hkv, capacity, hd) each.

    The caller sets ``at`` before a forward: an int writes the new T positions at
    ``at:at+T`` for every row; a LongTensor (B,) writes each row's single new position at its
    own index. ``len`` is how many positions attention then reads. ``generate`` does not tell
    the model how many tokens will come, so the capacity doubles when ``len`` outgrows it.
    """

    def __init__(self):
        self.k = self.v = None
        self.at, self.len = 0, 0

    def update(self, k, v):
        cap = 0 if self.k is None else self.k.shape[2]
        if self.len > cap:
            B, H, _, hd = k.shape
            shape = (B, H, max(self.len, 2 * cap), hd)
            new_k, new_v = k.new_zeros(shape), v.new_zeros(shape)
            if cap:
                new_k[:, :, :cap], new_v[:, :, :cap] = self.k, self.v
            self.k, self.v = new_k, new_v
        if isinstance(self.at, int):
            self.k[:, :, self.at : self.at + k.shape[2]] = k
            self.v[:, :, self.at : self.at + v.shape[2]] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            self.k[rows, :, self.at] = k[:, :, 0]
            self.v[rows, :, self.at] = v[:, :, 0]
        return self.k[:, :, : self.len], self.v[:, :, : self.len]


class Attention(nn.Module):
    def __init__(self, c: _Cfg, window):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.window = window
        self.qk_norm = c.qk_norm
        q_dim, kv_dim = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv = nn.Linear(c.d_model, q_dim + 2 * kv_dim, bias=c.bias)
        self.proj = nn.Linear(q_dim, c.d_model, bias=c.bias)
        if c.qk_norm == "layer":
            self.q_norm, self.k_norm = RMSNorm(q_dim, c.norm_eps), RMSNorm(kv_dim, c.norm_eps)
        elif c.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.hd, c.norm_eps), RMSNorm(self.hd, c.norm_eps)

    def forward(self, x, cos, sin, mask, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        if self.qk_norm == "layer":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, len, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv != self.n_heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, c: _Cfg):
        super().__init__()
        self.gated = c.backbone == "llama"
        self.fc = nn.Linear(c.d_model, (2 if self.gated else 1) * c.ffn_dim, bias=c.bias)
        self.proj = nn.Linear(c.ffn_dim, c.d_model, bias=c.bias)

    def forward(self, x):
        if self.gated:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c: _Cfg, window=None):
        super().__init__()
        self.parallel = c.parallel_residual
        self.attn_norm = make_norm(c, c.d_model)
        self.attn = Attention(c, window)
        self.mlp_norm = make_norm(c, c.d_model)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, cache=None):
        a = self.attn(self.attn_norm(x), cos, sin, mask, cache)
        if self.parallel:
            return self.mlp(self.mlp_norm(x)) + a + x
        x = x + a
        return x + self.mlp(self.mlp_norm(x))


def run_stack(blocks, x, cos, sin, masks, caches=None, at=0, length=0):
    """Run ``blocks`` on x (B, T, d); ``masks`` maps each block's window to its mask."""
    for i, blk in enumerate(blocks):
        cache = None
        if caches is not None:
            cache = caches[i]
            cache.at, cache.len = at, length
        x = blk(x, cos, sin, masks[blk.attn.window], cache)
    return x


def stack_windows(blocks):
    return {blk.attn.window for blk in blocks}


class Codebook(nn.Module):
    def __init__(self, c: _Cfg):
        super().__init__()
        S, N, ds = c.n_segments, c.concept["codes"], c.segment_dim
        self.base = nn.Parameter(torch.zeros(S, N, ds), requires_grad=c.concept["codebook"] == "learned")
        self.transform = None
        if c.concept["codebook"] != "learned":
            self.transform = nn.Sequential(nn.Linear(ds, 2 * ds), nn.ReLU(), nn.Linear(2 * ds, ds))

    def forward(self):
        return self.base if self.transform is None else self.transform(self.base)


def shift_blocks(pred, k: int, T: int):
    B, M, d = pred.shape
    z = torch.cat((pred.new_zeros(B, 1, d), pred), dim=1)
    return z[:, :, None].expand(B, M + 1, k, d).reshape(B, (M + 1) * k, d)[:, 1 : T + 1]


class ConceptModule(nn.Module):
    def __init__(self, c: _Cfg):
        super().__init__()
        cc = c.concept
        self.c = c
        self.k, self.S, self.N = cc["k"], c.n_segments, cc["codes"]
        self.layers = nn.ModuleList([Block(c, layer_window(c, i + 1)) for i in range(cc["concept_layers"])])
        self.norm = make_norm(c, c.d_model)
        self.heads = nn.Linear(c.d_model, self.S * self.N, bias=c.bias)
        self.codebook = Codebook(c)
        self.normed = cc["add"] == "normed"
        if self.normed:
            self.norm_h = make_norm(c, c.d_model)
            self.norm_pred = make_norm(c, c.d_model)

    # ---- pieces shared by the full forward and incremental decoding ----

    def positions(self, j):
        return j * self.k if self.c.concept.get("rope_scale_by_k") else j

    def predict(self, u, codes):
        """Concept-transformer output u (B, M, d) -> pred (B, M, d) as a mix of codes (S, N, ds)."""
        B, M, d = u.shape
        w = self.heads(self.norm(u)).view(B, M, self.S, self.N)
        if self.c.concept["code_weights"] == "softmax":
            w = w.softmax(dim=-1)
        return torch.einsum("bmsn,snd->bmsd", w, codes).reshape(B, M, d)

    def added_term(self, pred):
        return self.norm_pred(pred) if self.normed else pred

    def combine(self, h, added):
        """Decoder input z = h + added (or norm(h) + added), both (B, T, d)."""
        return (self.norm_h(h) if self.normed else h) + added

    def forward(self, h):
        B, T, d = h.shape
        k, M = self.k, T // self.k
        if M == 0:
            return self.norm_h(h) if self.normed else h
        c = h[:, : M * k].reshape(B, M, k, d).mean(dim=2)  # (B, M, d)
        cos, sin = rope(self.positions(torch.arange(M, device=h.device))[None], self.c, h.dtype)
        u = run_stack(self.layers, c, cos, sin, causal_masks(stack_windows(self.layers), M, h.device))
        return self.combine(h, shift_blocks(self.added_term(self.predict(u, self.codebook())), k, T))


@dataclass
class NCPCache:
    """Incremental-decoding state of a batch (spec section 5; see the module docstring)."""

    pad: list  # host ints: padding slots per row
    pad_t: torch.Tensor  # (B,) the same on the device
    slot: int  # next slot to write, shared by all rows
    enc: list  # KVCache per encoder layer
    dec: list  # KVCache per decoder layer
    con: list  # KVCache per concept layer, indexed by block number
    codes: torch.Tensor | None = None  # (S, N, ds), computed once at prefill
    block_sum: torch.Tensor | None = None  # (B, d) sum of h over the unfinished block
    pred: torch.Tensor | None = None  # (B, d) concept term added to the next token
    # generate's deferred stop check (mps) asks whether it may roll the cache back: it may not
    is_croppable = False

    def reorder_cache(self, beam_idx):
        """Keep rows ``beam_idx`` (B,) in that order (generate's beam search, after each step)."""
        self.pad = [self.pad[i] for i in beam_idx.tolist()]
        self.pad_t = self.pad_t[beam_idx]
        for kv in (*self.enc, *self.dec, *self.con):
            if kv.k is not None:  # a concept cache stays empty until the first block completes
                kv.k, kv.v = kv.k[beam_idx], kv.v[beam_idx]
        if self.pred is not None:  # None without a concept path
            self.block_sum, self.pred = self.block_sum[beam_idx], self.pred[beam_idx]


def _concept_prefill(cm, st, h, valid):
    """Concept path over left-padded prompts h (B, T, d) -> decoder input z (B, T, d); fills
    the concept caches, block sums and current pred of ``st``."""
    B, T, d = h.shape
    k, dev = cm.k, h.device
    ar = torch.arange(T, device=dev)
    lengths = T - st.pad_t  # (B,) real tokens per row
    # slot layout -> aligned layout (index = position, rows right-padded), (B, T, d)
    src = (ar[None] + st.pad_t[:, None]).clamp_max(T - 1)
    h_al = h.gather(1, src[..., None].expand(B, T, d))
    n_blocks = lengths // k  # (B,) complete blocks per row
    st.codes = cm.codebook()
    M = T // k
    if M > 0:
        # Right padding: a row's junk blocks (past its length) come after its real ones, so
        # the plain causal mask keeps them out of every real block's output.
        c = h_al[:, : M * k].reshape(B, M, k, d).mean(dim=2)  # (B, M, d)
        cos, sin = rope(cm.positions(torch.arange(M, device=dev))[None], cm.c, h.dtype)
        masks = causal_masks(stack_windows(cm.layers), M, dev)
        u = run_stack(cm.layers, c, cos, sin, masks, st.con, 0, M)
        pred = cm.added_term(cm.predict(u, st.codes))  # (B, M, d)
        added_al = shift_blocks(pred, k, T)  # (B, T, d)
        last = pred[torch.arange(B, device=dev), (n_blocks - 1).clamp_min(0)]  # (B, d)
        st.pred = torch.where((n_blocks > 0)[:, None], last, torch.zeros_like(last))
    else:
        added_al = torch.zeros_like(h)
        st.pred = h.new_zeros(B, d)
    # aligned -> slot layout; padding slots get nothing
    back = (ar[None] - st.pad_t[:, None]).clamp_min(0)
    added = added_al.gather(1, back[..., None].expand(B, T, d)) * valid[..., None]
    in_partial = (ar[None] >= (n_blocks * k)[:, None]) & (ar[None] < lengths[:, None])
    st.block_sum = (h_al * in_partial[..., None]).sum(dim=1)  # (B, d)
    return cm.combine(h, added)


def _concept_step(cm, st, h):
    """h (B, 1, d) of each row's new token -> decoder input z (B, 1, d).

    Rows that do not complete a block in this step compute a throw-away concept step
    (written at their next, not yet valid, block slot and overwritten when that block
    completes) and keep their pred. Pads are host ints, so which rows complete a block is
    known on the host: no device sync."""
    k, dev = cm.k, h.device
    st.block_sum = st.block_sum + h[:, 0]
    pos = [st.slot - p for p in st.pad]  # host positions of the new token
    done = [p % k == k - 1 for p in pos]
    if any(done):
        j = [p // k for p in pos]  # block index (done rows: the block just completed)
        pos_t = st.slot - st.pad_t  # (B,) the same on the device, without a host->device copy
        j_t, done_t = pos_t // k, (pos_t % k == k - 1)[:, None]
        c = (st.block_sum / k)[:, None]  # (B, 1, d) pooled block
        cos, sin = rope(cm.positions(j_t)[:, None], cm.c, h.dtype)
        keys = torch.arange(max(j) + 1, device=dev)
        masks = {w: attn_mask(j_t[:, None], keys[None], w) for w in stack_windows(cm.layers)}
        u = run_stack(cm.layers, c, cos, sin, masks, st.con, j_t, max(j) + 1)
        new = cm.added_term(cm.predict(u, st.codes))[:, 0]  # (B, d)
        st.pred = torch.where(done_t, new, st.pred)
        st.block_sum = st.block_sum.masked_fill(done_t, 0.0)
    return cm.combine(h, st.pred[:, None])


def left_padding(attention_mask, allow_right: bool) -> list:
    """Leading padding slots per row (host ints) of a (B, T) 0/1 mask whose ones must be
    contiguous; trailing zeros (right padding) only where ``allow_right``."""
    am = attention_mask.bool()
    T = am.shape[1]
    idx = torch.arange(T, device=am.device)
    first = torch.where(am, idx, T).amin(1)  # (B,) first real slot
    last = torch.where(am, idx, -1).amax(1)  # (B,) last real slot
    rows = torch.stack((first, last, am.sum(1))).t().tolist()
    for f, l, n in rows:
        if n == 0 or l - f + 1 != n:
            raise ValueError("attention_mask: every row needs real tokens, with padding only on the left "
                             "(or, without a cache, on the right), never inside")
        if l != T - 1 and not allow_right:
            raise ValueError("attention_mask: with a cache, pad on the left (new tokens follow the last slot)")
    return [f for f, _, _ in rows]


class NCPForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NCPConfig
    base_model_prefix = "ncp"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    # generate refuses assisted decoding for stateful models; it would need to roll NCPCache back
    _is_stateful = True

    def __init__(self, config: NCPConfig):
        super().__init__(config)
        c = _Cfg(config)
        self.c = c
        d = c.d_model
        self.embed = nn.Embedding(c.padded_vocab_size, d)
        blocks = [Block(c, layer_window(c, i + 1)) for i in range(c.n_token_layers)]
        E = c.encoder_layers
        self.encoder = nn.ModuleList(blocks[:E])
        self.decoder = nn.ModuleList(blocks[E:])
        self.concept = ConceptModule(c) if c.concept.get("enabled") else None
        self.final_norm = make_norm(c, d)
        self.lm_head = nn.Linear(d, c.padded_vocab_size, bias=False)
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"lm_head.weight": "embed.weight"}
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # generate must not build a DynamicCache: the forward creates and returns its NCPCache
        return False

    def token_layers(self):
        """Token layers in order (encoder then decoder)."""
        return [*self.encoder, *self.decoder]

    def forward(self, input_ids=None, attention_mask=None, labels=None, cache=None, use_cache=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, V). With ``cache`` (an NCPCache) T must be 1: one new
        token per row, the cache advances (``attention_mask`` is then not read: the padding is
        the prefill's). With ``use_cache`` (and no cache) the prompt is prefilled and the new
        NCPCache returned as ``cache``."""
        if cache is not None:
            if input_ids.shape[1] != 1:
                raise ValueError(f"with a cache, feed one new token per row, got {input_ids.shape[1]}")
            logits = self.decode_step(cache, input_ids[:, 0])
        else:
            pad = [0] * input_ids.shape[0]
            if attention_mask is not None and not bool(attention_mask.all()):
                pad = left_padding(attention_mask, allow_right=not use_cache)
            if use_cache or any(pad):
                logits, cache = self.prefill(input_ids, pad)
            else:
                logits = self._full(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def _full(self, input_ids):
        """The plain full forward of unpadded (or right-padded) rows: (B, T) -> logits (B, T, V)."""
        T = input_ids.shape[1]
        x = self.embed(input_ids)  # (B, T, d)
        cos, sin = rope(torch.arange(T, device=input_ids.device)[None], self.c, x.dtype)
        masks = causal_masks(stack_windows(self.token_layers()), T, input_ids.device)
        x = run_stack(self.encoder, x, cos, sin, masks)
        if self.concept is not None:
            x = self.concept(x)
        x = run_stack(self.decoder, x, cos, sin, masks)
        return self.lm_head(self.final_norm(x))

    def prefill(self, input_ids, pad):
        """Left-padded prompts (B, T) (row b's real tokens are its last T - pad[b] slots; ``pad``
        host ints) -> logits (B, T, V) (padding slots hold junk) and the NCPCache for decode_step."""
        B, T = input_ids.shape
        dev = input_ids.device
        st = NCPCache(pad=pad, pad_t=torch.tensor(pad, device=dev), slot=T,
                      enc=[KVCache() for _ in self.encoder], dec=[KVCache() for _ in self.decoder],
                      con=[KVCache() for _ in (self.concept.layers if self.concept is not None else [])])
        slots = torch.arange(T, device=dev)
        valid = slots[None] >= st.pad_t[:, None]  # (B, T) real tokens
        x = self.embed(input_ids)  # (B, T, d)
        cos, sin = rope((slots[None] - st.pad_t[:, None]).clamp_min(0), self.c, x.dtype)
        masks = {w: attn_mask(slots[None], slots[None], w, valid) for w in stack_windows(self.token_layers())}
        x = run_stack(self.encoder, x, cos, sin, masks, st.enc, 0, T)
        if self.concept is not None:
            x = _concept_prefill(self.concept, st, x, valid)
        x = run_stack(self.decoder, x, cos, sin, masks, st.dec, 0, T)
        return self.lm_head(self.final_norm(x)), st

    def decode_step(self, st, tokens):
        """One new token per row, tokens (B,) -> next-token logits (B, 1, V); advances ``st``."""
        s = st.slot
        dev = tokens.device
        x = self.embed(tokens[:, None])  # (B, 1, d)
        cos, sin = rope((s - st.pad_t)[:, None], self.c, x.dtype)
        keys = torch.arange(s + 1, device=dev)
        valid = keys[None] >= st.pad_t[:, None]  # (B, s+1)
        masks = {w: attn_mask(keys[s:][None], keys[None], w, valid) for w in stack_windows(self.token_layers())}
        x = run_stack(self.encoder, x, cos, sin, masks, st.enc, s, s + 1)
        if self.concept is not None:
            x = _concept_step(self.concept, st, x)
        x = run_stack(self.decoder, x, cos, sin, masks, st.dec, s, s + 1)
        st.slot += 1
        return self.lm_head(self.final_norm(x))
