"""The concept bottleneck's chunk arithmetic (module.py): labels and known-head logits per chunk of
``chunk`` tokens from position 0, at every position and over a subset of positions.

An objective says which positions the bottleneck's concept readout is trained and scored on
(``Objective.concept_positions``): None for next-token prediction (every position: bottleneck.py's
``chunk_bce`` and ``chunk_probs``), the masked positions (B, T) bool for the Causal Diffusion LM
(Steerling computes its concept loss on the masked tokens). Over positions ``keep``:

* a chunk's probability is the OR of its kept tokens, k_chunk = 1 - prod_{t in chunk, keep} (1 - k_t);
* its label is the OR of its kept tokens' labels;
* a chunk with no kept token contributes nothing: the BCE is the mean over the (row, chunk) pairs
  with a kept token (and the concepts), 0 when there is none, never NaN; detection scores those
  chunks only.

The labels and the states at the other positions never enter the loss, its gradient or the scores.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ---- label arithmetic (chunks of ``chunk`` tokens from position 0) ----


def chunked(x: torch.Tensor, chunk: int, fill: float = 0.0) -> torch.Tensor:
    """(B, T, n) -> (B, C, chunk, n), C = ceil(T / chunk), the tail padded with ``fill``."""
    B, T, n = x.shape
    C = -(-T // chunk)
    if C * chunk != T:
        x = torch.cat([x, x.new_full((B, C * chunk - T, n), fill)], dim=1)
    return x.view(B, C, chunk, n)


def chunk_labels(labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token labels (B, T, n) -> chunk labels (B, C, n): the OR of the chunk's tokens (float)."""
    return chunked(labels.float(), chunk).amax(dim=2)


def causal_labels(labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, T, n) -> (B, T, n): concept c at token t iff a token s <= t of t's chunk carries c."""
    T = labels.shape[1]
    x = chunked(labels.float(), chunk).cummax(dim=2).values
    return x.flatten(1, 2)[:, :T]


def fed_labels(labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, T, n) -> (B, T, n): what teacher forcing feeds token t of chunk j, the label of chunk j - 1
    (the OR of its tokens; zeros in chunk 0), the chunk that closed before t. No label at or after
    chunk j's first token reaches it (the module docstring)."""
    B, T, n = labels.shape
    y = chunk_labels(labels, chunk)  # (B, C, n)
    prev = torch.cat([y.new_zeros(B, 1, n), y[:, :-1]], dim=1)
    return prev.repeat_interleave(chunk, dim=1)[:, :T]


def chunk_mask(B: int, T: int, chunk: int, alpha: float, device) -> torch.Tensor:
    """(B, T, 1) bool: one Bernoulli(alpha) draw per (row, chunk), spread over its tokens."""
    C = -(-T // chunk)
    draw = torch.rand(B, C, 1, device=device) < alpha
    return draw.repeat_interleave(chunk, dim=1)[:, :T]


def _log_or(z: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Known logits (B, T, n) -> (log k_chunk, log(1 - k_chunk)) per chunk (B, C, n), fp32."""
    s = chunked(F.logsigmoid(-z.float()), chunk).sum(dim=2).clamp_max(-1e-30)  # log prod_t (1 - k_t)
    # log(1 - exp(s)), stable on both sides of -ln 2
    log_p = torch.where(s > -math.log(2), torch.log(-torch.expm1(s)), torch.log1p(-torch.exp(s)))
    return log_p, s


def chunk_probs(z: torch.Tensor, chunk: int) -> torch.Tensor:
    """Known logits (B, T, n) -> the OR-aggregated chunk probabilities 1 - prod_t (1 - k_t), (B, C, n)."""
    return _log_or(z, chunk)[0].exp()


def chunk_bce(z: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean BCE of the OR-aggregated chunk probabilities against the chunk labels."""
    log_p, log_q = _log_or(z, chunk)
    y = chunk_labels(labels, chunk)
    return -(y * log_p + (1 - y) * log_q).mean()


# ---- over a subset of positions ----


def _log_or_at(z: torch.Tensor, chunk: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Known logits (B, T, n), kept positions (B, T) bool -> (log k_chunk, log(1 - k_chunk)) per chunk
    (B, C, n) over the kept tokens, fp32, and which chunks hold one (B, C) bool. A chunk with none gets
    finite placeholder values (log 1/2 both; its caller drops it) and no gradient."""
    terms = torch.where(keep[..., None], F.logsigmoid(-z.float()), torch.zeros((), device=z.device))
    s = chunked(terms, chunk).sum(dim=2)  # (B, C, n) log prod (1 - k_t) over the kept tokens
    has = chunked(keep[..., None].float(), chunk).amax(dim=(2, 3)) > 0  # (B, C)
    s = torch.where(has[..., None], s.clamp_max(-1e-30), torch.full_like(s, -math.log(2)))
    # log(1 - exp(s)), stable on both sides of -ln 2 (bottleneck._log_or)
    log_p = torch.where(s > -math.log(2), torch.log(-torch.expm1(s)), torch.log1p(-torch.exp(s)))
    return log_p, s, has


def chunk_labels_at(labels: torch.Tensor, chunk: int, keep: torch.Tensor) -> torch.Tensor:
    """Token labels (B, T, n) -> chunk labels (B, C, n): the OR of the chunk's kept tokens' labels."""
    return chunked(labels.float() * keep[..., None], chunk).amax(dim=2)


def chunk_bce_at(z: torch.Tensor, labels: torch.Tensor, chunk: int, keep: torch.Tensor) -> torch.Tensor:
    """The concept loss over kept positions: the mean BCE of each contributing chunk's OR over its kept
    tokens against the OR of their labels (0 without a contributing chunk)."""
    log_p, log_q, has = _log_or_at(z, chunk, keep)
    y = chunk_labels_at(labels, chunk, keep)
    bce = -(y * log_p + (1 - y) * log_q).sum(-1)  # (B, C)
    return (bce * has).sum() / (has.sum() * z.shape[-1]).clamp_min(1)


def chunk_detection_at(z: torch.Tensor, labels: torch.Tensor, chunk: int,
                       keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, labels) (N, n) of the N chunks with a kept token: held-out detection as the loss reads it."""
    log_p, _, has = _log_or_at(z, chunk, keep)
    return log_p.exp()[has], chunk_labels_at(labels, chunk, keep)[has]


def held_at(labels: torch.Tensor, chunk: int, keep: torch.Tensor) -> torch.Tensor:
    """(B, T, n) bool: concept c at a kept position t iff the label of t's chunk over its kept tokens
    carries c (a steering stage's injection slots: where the concept loss says c is in the text)."""
    T = labels.shape[1]
    y = chunk_labels_at(labels, chunk, keep) > 0  # (B, C, n)
    return y.repeat_interleave(chunk, dim=1)[:, :T] & keep[..., None]


def block_labels(labels: torch.Tensor, block: int) -> torch.Tensor:
    """(B, T, n) -> (B, T, n) float: each token's own block's label, the OR of the block's tokens
    (teacher forcing on a Causal Diffusion LM, whose unit of generation is the block)."""
    T = labels.shape[1]
    return chunked(labels.float(), block).amax(dim=2).repeat_interleave(block, dim=1)[:, :T]
