"""The block-parallel drafter of NCP-ArchPreview Sec. 5.3 (DFlash-style), a plain ``nn.Module``.

It reads a frozen target's hidden states and proposes K tokens at once:

    feats (N, W, L*d)  the target's residual stream at L token layers, at the W last verified
                       positions (each layer RMS-normalised, then concatenated)
      -> fc + RMSNorm  -> context states (N, W, d): every draft layer's extra keys and values
    block (N, K, d)    slot 0: the target's embedding of the pending token x (committed, not yet
                       fed to the target); slots 1..K-1: a learned mask embedding
      -> n_layers draft layers: the block attends to the context and to itself (bidirectional
         inside the block, DFlash), RoPE at the tokens' own positions, SwiGLU MLP
      -> final RMSNorm -> (N, K, d); the caller reads it with the target's LM head
    slot i predicts the token i + 1 places after x (d_{i+1}).

Concept injection (Eq. 26): before draft layer l every draft slot gets
``tanh(g_l) * RMSNorm_l(c)``, g_l (d,) zero-initialised, so a drafter with injection computes
exactly what the same weights without it compute until g moves. c is the target's concept of the
last complete block of the verified prefix: ``pooled`` (mean of the target's encoder output over
that block, the concept module's input) or ``predicted`` (the concept module's prediction made
from that block, as the term the target's coupling adds to the next tokens: norm(pred) with
``concept.add: normed``). Which one is recorded in the config (``concept_source``) and so in
every drafter checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.layers import RMSNorm

CONCEPT_SOURCES = ("pooled", "predicted")


def spread_layers(n_layers: int, n: int = 5) -> list[int]:
    """``n`` token-layer indices spread evenly over a target of ``n_layers`` layers (the report mixes
    five), first and last included."""
    m = min(n, n_layers)
    return sorted({round(i * (n_layers - 1) / max(m - 1, 1)) for i in range(m)})


@dataclass
class DrafterConfig:
    """The drafter's shape; the target-derived fields (``d_model`` .. ``concept_k``) are copied
    from the target's ``ModelConfig`` by ``for_target`` and checked against it when loading."""

    d_model: int  # the target's width (the drafter shares its embedding and LM head)
    n_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int  # the target's padded vocabulary (its LM head's rows)
    n_target_layers: int  # E + D token layers of the target
    concept_k: int | None  # tokens per concept block of the target (None: no fixed-block concept path)
    target_layers: list[int] = field(default_factory=list)  # token layers whose outputs are mixed
    n_layers: int = 2  # draft layers
    k: int = 8  # draft slots: tokens proposed per round
    window: int = 32  # verified positions the block attends to (the latest W)
    concept_injection: bool = False  # Eq. 26 on/off
    concept_source: str = "pooled"  # "pooled" | "predicted" (see the module doc)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        problems = []
        if self.k < 1:
            problems.append(f"k (draft tokens) must be >= 1, got {self.k}")
        if self.n_layers < 1 or self.window < 1:
            problems.append(f"n_layers and window must be >= 1, got {self.n_layers}, {self.window}")
        if not self.target_layers:
            self.target_layers = spread_layers(self.n_target_layers)
        bad = [i for i in self.target_layers if not 0 <= i < self.n_target_layers]
        if bad:
            problems.append(f"target_layers {bad} outside the target's {self.n_target_layers} token layers")
        if self.concept_source not in CONCEPT_SOURCES:
            problems.append(f"concept_source must be one of {', '.join(CONCEPT_SOURCES)}, got {self.concept_source!r}")
        if self.concept_injection and self.concept_k is None:
            problems.append("concept_injection needs a target with fixed concept blocks (model.concept)")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def for_target(cls, cfg, **kw) -> "DrafterConfig":
        """The drafter of target ``cfg`` (a ``ModelConfig``) with the drafter keys ``kw``."""
        concept_k = cfg.concept.k if cfg.concept.enabled else None
        return cls(d_model=cfg.d_model, n_heads=cfg.n_heads, head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim,
                   vocab_size=cfg.padded_vocab_size, n_target_layers=cfg.encoder_layers + cfg.decoder_layers,
                   concept_k=concept_k, rope_base=float(getattr(cfg, "rope_base", 10000.0)), **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Full RoPE (rotate-half) of x (N, H, T, hd) with cos, sin (N, 1, T, hd)."""
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


class DraftLayer(nn.Module):
    """Pre-norm attention (queries: the block; keys/values: context then block) and a SwiGLU MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, hd, H = cfg.d_model, cfg.head_dim, cfg.n_heads
        self.H, self.hd = H, hd
        self.attn_norm, self.mlp_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.q = nn.Linear(d, H * hd, bias=False)
        self.kv = nn.Linear(d, 2 * H * hd, bias=False)
        self.o = nn.Linear(H * hd, d, bias=False)
        self.fc = nn.Linear(d, 2 * cfg.ffn_dim, bias=False)
        self.proj = nn.Linear(cfg.ffn_dim, d, bias=False)

    def context_kv(self, ctx: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (N, T, d) states at positions whose RoPE is ``rope`` -> their keys (rotated) and values
        (N, H, T, hd). Position-wise: a decoder computes a verified token's once and caches it."""
        N, T, _ = ctx.shape
        k, v = (t.transpose(1, 2) for t in self.kv(ctx).view(N, T, 2, self.H, self.hd).unbind(2))
        return _rotate(k, *rope), v

    def forward(self, x: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], rope_q,
                mask: torch.Tensor) -> torch.Tensor:
        """x (N, K, d) the block, ctx_kv the context's keys and values (N, H, W, hd) (``context_kv``),
        mask (N, 1, K, W+K) bool."""
        N, K, _ = x.shape
        hx = self.attn_norm(x)
        q = _rotate(self.q(hx).view(N, K, self.H, self.hd).transpose(1, 2), *rope_q)  # (N, H, K, hd)
        k, v = self.context_kv(hx, rope_q)  # the block's own keys and values, at its positions
        k, v = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)  # (N, H, W+K, hd)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (N, H, K, hd)
        x = x + self.o(a.transpose(1, 2).reshape(N, K, -1))
        g, u = self.fc(self.mlp_norm(x)).chunk(2, -1)
        return x + self.proj(F.silu(g) * u)


class ConceptInjection(nn.Module):
    """Eq. 26 at one draft layer: tanh(g) * RMSNorm(c), g (d,) zero-initialised."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.gate = nn.Parameter(torch.zeros(d))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        """c (N, d) -> the term added to every draft slot (N, 1, d)."""
        return (torch.tanh(self.gate) * self.norm(c))[:, None]


class BlockDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.fc = nn.Linear(len(cfg.target_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        # built last: the weights above draw the same random numbers with injection on or off
        self.inject = nn.ModuleList(ConceptInjection(d, cfg.norm_eps) for _ in range(cfg.n_layers)) \
            if cfg.concept_injection else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for layer in self.layers:  # residual outputs scaled down with depth (GPT-2)
            for m in (layer.o, layer.proj):
                m.weight.mul_(1 / math.sqrt(2 * self.cfg.n_layers))
        nn.init.normal_(self.mask_embed, std=0.02)

    def _rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, 1, T, hd) of integer positions (N, T)."""
        hd = self.cfg.head_dim
        inv = self.cfg.rope_base ** (-torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd)
        f = pos.clamp_min(0)[..., None].float() * inv
        emb = torch.cat((f, f), -1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def context(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats (N, T, L*d) the target's states at positions pos (N, T) -> per draft layer the keys
        (RoPE'd) and values (N, H, T, hd) the block attends to there. Position-wise (each position
        reads only its own states), so speculative decoding computes them once per verified token
        instead of over the whole window every round."""
        N, T, _ = feats.shape
        d, L = self.cfg.d_model, len(self.cfg.target_layers)
        f = feats.view(N, T, L, d)
        f = f * torch.rsqrt(f.float().pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps).to(f.dtype)
        ctx = self.hidden_norm(self.fc(f.reshape(N, T, L * d)))  # (N, T, d)
        rope = self._rope(pos, ctx.dtype)
        return [layer.context_kv(ctx, rope) for layer in self.layers]

    def block(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor, x_pos: torch.Tensor,
              x_emb: torch.Tensor, concept: torch.Tensor | None = None) -> torch.Tensor:
        """The K draft slots over the context of ``context`` (ctx_valid (N, W) bool: a real verified
        position), x_emb (N, d) the pending token's embedding at position x_pos (N, 1), concept
        (N, d) (injection only) -> the block's final states (N, K, d)."""
        N, W = ctx_valid.shape
        K, d = self.cfg.k, self.cfg.d_model
        x = torch.cat([x_emb[:, None], self.mask_embed.expand(N, K - 1, d)], 1)  # (N, K, d)
        rope_q = self._rope(x_pos + torch.arange(K, device=x.device)[None], x.dtype)  # (N, K) positions
        mask = torch.cat([ctx_valid, ctx_valid.new_ones(N, K)], 1)[:, None, None].expand(N, 1, K, W + K)
        for i, layer in enumerate(self.layers):
            if self.inject is not None:
                x = x + self.inject[i](concept)
            x = layer(x, ctx_kv[i], rope_q, mask)
        return self.final_norm(x)

    def forward(self, feats: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor, x_emb: torch.Tensor,
                concept: torch.Tensor | None = None) -> torch.Tensor:
        """feats (N, W, L*d) the target's states at the context positions ctx_pos (N, W) (ctx_valid
        (N, W) bool: a real verified position), x_emb (N, d) the pending token's embedding (its
        position: the last context position + 1), concept (N, d) (injection only) -> the block's
        final states (N, K, d)."""
        return self.block(self.context(feats, ctx_pos), ctx_valid, ctx_pos[:, -1:] + 1, x_emb, concept)
