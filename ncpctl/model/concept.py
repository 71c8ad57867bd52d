"""The concept path (spec sections 1-3): pooling, concept transformer, heads, codebook, losses.

Shapes: B batch, T tokens, k tokens per block, M = T // k blocks, d width, S segments,
N codes per segment, ds = d / S segment width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.config import ModelConfig
from ncpctl.model.layers import Block, causal_masks, layer_window, make_norm, rope, run_stack, stack_windows


class Codebook(nn.Module):
    """Product-quantised SimVQ codebook: codes = transform(base), (S, N, ds).

    ``base`` is a frozen Gaussian (std ds**-0.5), kept as a non-trainable Parameter so it is
    counted and saved; only ``transform`` (shared across segments) trains. With
    ``codebook: learned`` the base itself is the trainable codebook and there is no transform.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        S, N, ds = cfg.n_segments, cfg.concept.codes, cfg.segment_dim
        learned = cfg.concept.codebook == "learned"
        self.base = nn.Parameter(torch.empty(S, N, ds), requires_grad=learned)
        self.transform = None
        if not learned:
            self.transform = nn.Sequential(nn.Linear(ds, 2 * ds), nn.ReLU(), nn.Linear(2 * ds, ds))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # SimVQ: Gaussian codes of unit expected norm, projection with PyTorch's default init.
        nn.init.normal_(self.base, std=self.base.shape[-1] ** -0.5)
        if self.transform is not None:
            for m in self.transform:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()

    def forward(self) -> torch.Tensor:
        return self.base if self.transform is None else self.transform(self.base)  # (S, N, ds)


def nearest_code(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Index (B, M, S) of the nearest code per segment for x (B, M, d), codes (S, N, ds)."""
    B, M, _ = x.shape
    S, N, ds = codes.shape
    xs = x.reshape(B, M, S, ds)
    # ||x - e||^2 = ||x||^2 - 2 x.e + ||e||^2; ||x||^2 does not change the argmin.
    dist = codes.pow(2).sum(-1) - 2 * torch.einsum("bmsd,snd->bmsn", xs, codes)  # (B, M, S, N)
    return dist.argmin(-1)


def shift_blocks(pred: torch.Tensor, k: int, T: int) -> torch.Tensor:
    """Causal shift (spec 1): position p gets pred[(p+1)//k - 1], zeros for p < k-1.

    repeat_interleave(cat(0, pred), k), drop the first position, cut to T: (B, M, d) -> (B, T, d).
    """
    B, M, d = pred.shape
    z = torch.cat((pred.new_zeros(B, 1, d), pred), dim=1)  # (B, M+1, d)
    return z[:, :, None].expand(B, M + 1, k, d).reshape(B, (M + 1) * k, d)[:, 1 : T + 1]


@dataclass
class ConceptAux:
    """What the concept path hands back besides the decoder input (training terms)."""

    pred: torch.Tensor | None = None  # (B, M, d) predicted next-block states
    ncp_loss: torch.Tensor | None = None
    vq_loss: torch.Tensor | None = None
    code_usage: torch.Tensor | None = None  # (S,) fraction of codes hit
    code_perplexity: torch.Tensor | None = None  # (S,) exp(entropy) of code usage
    ncp_code_acc: torch.Tensor | None = None  # (S,) nearest code of pred[j] == of c[j+1]


class ConceptModule(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = cfg.concept
        self.cfg = cfg
        self.k, self.S, self.N = c.k, cfg.n_segments, c.codes
        self.layers = nn.ModuleList([Block(cfg, layer_window(cfg, i + 1)) for i in range(c.concept_layers)])
        self.norm = make_norm(cfg, cfg.d_model)
        # S per-segment heads fused into one matmul: (B, M, d) -> (B, M, S*N).
        self.heads = nn.Linear(cfg.d_model, self.S * self.N, bias=cfg.bias)
        self.codebook = Codebook(cfg)
        self.normed = c.add == "normed"
        if self.normed:  # GPT-2 variant: norm(h) + norm(pred)
            self.norm_h = make_norm(cfg, cfg.d_model)
            self.norm_pred = make_norm(cfg, cfg.d_model)

    # ---- pieces shared by the full forward and incremental decoding ----

    def positions(self, j: torch.Tensor) -> torch.Tensor:
        return j * self.k if self.cfg.concept.rope_scale_by_k else j

    def predict(self, u: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Concept-transformer output u (B, M, d) -> pred (B, M, d) as a mix of codes."""
        B, M, d = u.shape
        w = self.heads(self.norm(u)).view(B, M, self.S, self.N)  # (B, M, S, N)
        if self.cfg.concept.code_weights == "softmax":  # pred in the convex hull of each segment
            w = w.softmax(dim=-1)
        return torch.einsum("bmsn,snd->bmsd", w, codes).reshape(B, M, d)

    def added_term(self, pred: torch.Tensor) -> torch.Tensor:
        """What is added per block (normed once per block, so the zero-shifted slots stay 0)."""
        return self.norm_pred(pred) if self.normed else pred

    def combine(self, h: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
        """Decoder input z = h + added (or norm(h) + norm(pred)), both (B, T, d)."""
        if self.cfg.concept.detach_added_concept:
            added = added.detach()
        return (self.norm_h(h) if self.normed else h) + added

    # ---- full-sequence forward ----

    def forward(self, h: torch.Tensor, losses: bool) -> tuple[torch.Tensor, ConceptAux]:
        """Encoder output h (B, T, d) -> decoder input z (B, T, d) and the training terms."""
        B, T, d = h.shape
        k, M = self.k, T // self.k
        aux = ConceptAux()
        if M == 0:  # no complete block: nothing to predict, nothing added
            zero = h.new_zeros(())
            if losses:
                aux.ncp_loss, aux.vq_loss = zero, zero
            return self.combine(h, torch.zeros_like(h)), aux
        c = h[:, : M * k].reshape(B, M, k, d).mean(dim=2)  # (B, M, d); trailing partial block dropped
        pos = self.positions(torch.arange(M, device=h.device))[None]
        cos, sin = rope(pos, self.cfg, h.dtype)
        u = run_stack(self.layers, c, cos, sin, causal_masks(stack_windows(self.layers), M, h.device))
        codes = self.codebook()  # (S, N, ds)
        pred = self.predict(u, codes)  # (B, M, d); pred[j] predicts c[j+1]
        z = self.combine(h, shift_blocks(self.added_term(pred), k, T))
        aux.pred = pred
        if losses:
            self._losses(c, pred, codes, aux)
        return z, aux

    def _losses(self, c: torch.Tensor, pred: torch.Tensor, codes: torch.Tensor, aux: ConceptAux) -> None:
        cfg = self.cfg.concept
        B, M, d = c.shape
        # NCP: predict the continuous pooled state of the next block; the target is detached.
        if M >= 2:
            err = (pred[:, :-1] - c[:, 1:].detach()).pow(2)
            aux.ncp_loss = err.mean() if cfg.ncp_reduction == "mean" else err.sum(-1).mean()
        else:
            aux.ncp_loss = c.new_zeros(())
        # VQ on sg(c): trains only the codebook transform (the commitment term moves nothing).
        cs = c.detach()
        idx = nearest_code(cs, codes.detach())  # (B, M, S)
        q = codes[torch.arange(self.S, device=c.device), idx].reshape(B, M, d)  # (B, M, d), grad -> codes
        aux.vq_loss = F.mse_loss(q, cs) + cfg.commitment * F.mse_loss(cs, q.detach())
        with torch.no_grad():  # metrics as tensors: no host sync on the hot path
            counts = torch.zeros(self.S, self.N, device=c.device)
            flat = idx.reshape(-1, self.S).t()  # (S, B*M)
            counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=counts.dtype))  # (S, N) hits per code
            aux.code_usage = (counts > 0).float().mean(-1)
            p = counts / counts.sum(-1, keepdim=True)
            aux.code_perplexity = torch.exp(-(p * p.clamp_min(1e-12).log()).sum(-1))
            if M >= 2:
                idx_pred = nearest_code(pred[:, :-1].detach(), codes.detach())
                aux.ncp_code_acc = (idx_pred == idx[:, 1:]).float().mean(dim=(0, 1))
