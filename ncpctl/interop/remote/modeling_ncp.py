"""NCP / ConceptLM causal LM for HF transformers: self-contained (torch + transformers).

Written by ``ncpctl export``; the same computation as ncpctl's ``NCPModel`` (spec:
ncp-model.md sections 1-4), checked by the exporter on a probe batch. Data flow:

    tokens -> embed -> encoder (E layers) -> h                      (B, T, d)
    h -> mean-pool blocks of k -> concept transformer (C layers)    (B, M, d), M = T // k
      -> S heads x N codes -> pred (mix of codebook vectors)       (B, M, d)
    z[p] = h[p] + pred[(p+1)//k - 1] (0 for p < k-1)                (B, T, d)
    z -> decoder (D layers) -> final norm -> LM head -> logits      (B, T, V)

Concept blocks are anchored at position 0, so sequences must not be left-padded (an
``attention_mask`` with padding anywhere but at the right end is rejected). There is no
KV cache: ``generate`` recomputes the whole sequence each step (correct, slow); ncpctl's
own ``generate`` decodes incrementally.
"""

from __future__ import annotations

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

    def forward(self, x, cos, sin, mask):
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

    def forward(self, x, cos, sin, mask):
        a = self.attn(self.attn_norm(x), cos, sin, mask)
        if self.parallel:
            return self.mlp(self.mlp_norm(x)) + a + x
        x = x + a
        return x + self.mlp(self.mlp_norm(x))


def run_stack(blocks, x, cos, sin, masks):
    for blk in blocks:
        x = blk(x, cos, sin, masks[blk.attn.window])
    return x


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

    def forward(self, h):
        B, T, d = h.shape
        k, M = self.k, T // self.k
        base = self.norm_h(h) if self.normed else h
        if M == 0:
            return base
        c = h[:, : M * k].reshape(B, M, k, d).mean(dim=2)  # (B, M, d)
        j = torch.arange(M, device=h.device)
        pos = j * k if self.c.concept.get("rope_scale_by_k") else j
        cos, sin = rope(pos[None], self.c, h.dtype)
        u = run_stack(self.layers, c, cos, sin, causal_masks({b.attn.window for b in self.layers}, M, h.device))
        w = self.heads(self.norm(u)).view(B, M, self.S, self.N)
        if self.c.concept["code_weights"] == "softmax":
            w = w.softmax(dim=-1)
        pred = torch.einsum("bmsn,snd->bmsd", w, self.codebook()).reshape(B, M, d)
        added = self.norm_pred(pred) if self.normed else pred
        return base + shift_blocks(added, k, T)


class NCPForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NCPConfig
    base_model_prefix = "ncp"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

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

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if attention_mask is not None and attention_mask.numel() and not bool(attention_mask.all()):
            am = attention_mask.long()
            if bool((am[:, 1:] > am[:, :-1]).any()):  # a 0 followed by a 1: left or inner padding
                raise ValueError("NCP models need unpadded or right-padded inputs (concept blocks start at "
                                 "position 0); left padding would shift them")
        T = input_ids.shape[1]
        x = self.embed(input_ids)  # (B, T, d)
        cos, sin = rope(torch.arange(T, device=input_ids.device)[None], self.c, x.dtype)
        blocks = [*self.encoder, *self.decoder]
        masks = causal_masks({b.attn.window for b in blocks}, T, input_ids.device)
        x = run_stack(self.encoder, x, cos, sin, masks)
        if self.concept is not None:
            x = self.concept(x)
        x = run_stack(self.decoder, x, cos, sin, masks)
        logits = self.lm_head(self.final_norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
