"""The concept bottleneck's top-k heads without their dense activations, and its attribution over them
(bottleneck.py; issue 43).

At Steerling-8B's size a dense readout holds (tokens, 33,732) known and (tokens, 101,196) unknown
activations: 2.2 GB in fp32 for 4096 tokens. With ``top_k_known`` / ``top_k_unknown`` set and no
gradient wanted (evaluation, generation, inspection), a head streams over its concepts in blocks of
``BLOCK``, keeping each token's running top-k of the (clamped) logits, as Steerling's released
``ConceptHead`` does (``linear_features_topk_streaming``, ``linear_features_topk_factorized``); the
largest tensors are then (tokens, BLOCK) logits of one block and the (tokens, k) survivors. The
features are weighted sums of the selected embedding rows (``F.embedding_bag``: no (tokens, k, d)
gather either):

    known    k_hat = sum_j sigmoid(z_j) K[j]          over the top-k j of z = f(h)
    unknown  u_hat = (sum_j sigmoid(z_j) A[j]) B      over the top-k j of z = g(sg(h))

Ranking by the logit, not the sigmoid, is the same order (the sigmoid is increasing; Steerling ranks
the known head by the sigmoid, the unknown by the logit) and has no ties where the sigmoid rounds to
1 in fp32. With gradients (training) the heads stay dense: the concept loss reads every known logit,
and the cost model (``BottleneckCost``) counts the dense matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

@dataclass
class Attribution:
    """Exact logit attribution of tokens y (B, T), in fp32: logit = known + unknown + residual +
    steering, and known = per_concept.sum(-1) with per_concept[..., c] = k_c (K_c . W_y)."""

    logit: torch.Tensor  # (B, T)
    known: torch.Tensor  # (B, T)  k_hat . W_y
    unknown: torch.Tensor  # (B, T)  u_hat . W_y
    residual: torch.Tensor  # (B, T)  e . W_y
    per_concept: torch.Tensor | None  # (B, T, n)
    steering: torch.Tensor | None = None  # (B, T)  steer . W_y: readout steering (zeros without)
    # a sparse known head's per_concept is (B, T, top_k) over these concepts (None: dense, over all n)
    known_index: torch.Tensor | None = None  # (B, T, top_k_known)
    unknown_index: torch.Tensor | None = None  # (B, T, k_u): the unknown concepts of per_unknown
    per_unknown: torch.Tensor | None = None  # (B, T, k_u)  u_j (U_j . W_y), U = A B (the top-k_u; all m if dense)

    @property
    def share(self) -> torch.Tensor:
        """(B, T) the concepts' share of the logit magnitude (module docstring)."""
        k, u, e = self.known.abs(), self.unknown.abs(), self.residual.abs()
        return (k + u) / (k + u + e).clamp_min(1e-12)



BLOCK = 4096  # concepts per streamed block: (tokens, BLOCK) logits at a time


def clamped(z: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """The logits a head's sigmoid and top-k read: z clamped to [-clamp, clamp] (``logit_clamp``)."""
    return z if clamp is None else z.clamp(-clamp, clamp)


def top_logits(x: torch.Tensor, linear: nn.Linear, k: int, clamp: float | None,
               block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest clamped logits of ``linear`` on rows x (N, d_in), streamed over the output rows in
    blocks: (values (N, k) fp32, indices (N, k) long), largest first."""
    w, b = linear.weight, linear.bias
    C = w.shape[0]
    best_v = best_i = None
    for s in range(0, C, block):
        e = min(s + block, C)
        z = F.linear(x, w[s:e], None if b is None else b[s:e])  # (N, e - s)
        v, i = clamped(z, clamp).float().topk(min(k, e - s), dim=-1)
        if best_v is not None:
            v, i = torch.cat([best_v, v], -1), torch.cat([best_i, i + s], -1)
            v, sel = v.topk(min(k, v.shape[-1]), dim=-1)
            i = i.gather(-1, sel)
        best_v, best_i = v, i
    return best_v, best_i


def weighted_rows(index: torch.Tensor, value: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """sum_j value[n, j] * table[index[n, j]]: (N, k) x (C, w) -> (N, w), without the (N, k, w) gather."""
    return F.embedding_bag(index, table, per_sample_weights=value.to(table.dtype), mode="sum")


def known_top(h: torch.Tensor, known: nn.Linear, K: torch.Tensor, k: int, clamp: float | None):
    """The known head on final-norm states h (B, T, d), top-k only: (k_hat (B, T, d), indices (B, T, k),
    activations sigmoid(z) (B, T, k) fp32)."""
    B, T, d = h.shape
    z, idx = top_logits(h.reshape(B * T, d), known, k, clamp)
    act = torch.sigmoid(z)
    return weighted_rows(idx, act, K).to(h.dtype).view(B, T, d), idx.view(B, T, -1), act.view(B, T, -1)


def unknown_top(hd: torch.Tensor, unknown: nn.Module, A: torch.Tensor, Bm: torch.Tensor, k: int,
                clamp: float | None):
    """The unknown head on sg(h) (B, T, d), top-k only: g is ``unknown`` (a Linear, or a Sequential whose
    last Linear is the concept layer: d -> r -> m); (u_hat (B, T, d), indices (B, T, k), activations
    (B, T, k) fp32). u_hat = (sum_j u_j A[j]) B: rank r in between, as the dense (u A) B."""
    B, T, d = hd.shape
    x, last = hd.reshape(B * T, d), unknown
    if isinstance(unknown, nn.Sequential):
        *pre, last = unknown
        for m in pre:
            x = m(x)
    z, idx = top_logits(x, last, k, clamp)
    act = torch.sigmoid(z)
    u_hat = (weighted_rows(idx, act, A) @ Bm).to(hd.dtype)
    return u_hat.view(B, T, d), idx.view(B, T, -1), act.view(B, T, -1)


def _top(dense: torch.Tensor | None, index: torch.Tensor | None, value: torch.Tensor | None, k: int | None):
    """(indices, activations) (B, T, k) of a head: a sparse head's own, else the k largest of the dense
    activations (B, T, C) (all C without a top-k)."""
    if index is not None:
        return index, value
    v, i = dense.float().topk(min(k or dense.shape[-1], dense.shape[-1]), dim=-1)
    return i, v


def attribute(bottleneck, parts, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, per_concept: bool = True):
    """``ConceptBottleneck.attribute`` (its docstring), dense or sparse heads, in fp32."""

    b = bottleneck.bcfg
    w = lm_head_weight[token_ids].float()  # (B, T, d) W_y
    dot = lambda x: (x * w).sum(-1)  # noqa: E731
    steer = parts.steer.float() if parts.steer is not None else torch.zeros_like(w)
    K, u_hat = bottleneck.K.float(), parts.u_hat.float()
    known_index = terms = unknown_index = per_unknown = None
    if not per_concept:
        k_hat = parts.k_hat.float()
    elif parts.k is not None:  # dense: k K again in fp32, so that the terms sum to ``known`` in any dtype
        k = parts.k.float()
        k_hat, terms = k @ K, k * torch.einsum("btd,nd->btn", w, K)  # (B, T, d), (B, T, n)
    else:
        known_index, act = parts.k_index, parts.k_value.float()
        B_, T_, kk = known_index.shape
        k_hat = weighted_rows(known_index.reshape(B_ * T_, kk), act.reshape(B_ * T_, kk), K).view_as(w)
        terms = act * torch.einsum("btjd,btd->btj", K[known_index], w)  # (B, T, top-k)
    if per_concept:
        unknown_index, act = _top(parts.u, parts.u_index, parts.u_value, b.top_k_unknown)
        bw = torch.einsum("rd,btd->btr", bottleneck.B.float(), w)  # B W_y: U_j . W_y = A_j . (B W_y)
        per_unknown = act.float() * torch.einsum("btjr,btr->btj", bottleneck.A.float()[unknown_index], bw)
    e = parts.h_bar.float() - k_hat - u_hat - steer  # == parts.e in an fp32 evaluation
    known, unknown, residual, steering = dot(k_hat), dot(u_hat), dot(e), dot(steer)
    return Attribution(logit=known + unknown + residual + steering, known=known, unknown=unknown,
                       residual=residual, per_concept=terms, steering=steering, known_index=known_index,
                       unknown_index=unknown_index, per_unknown=per_unknown)
