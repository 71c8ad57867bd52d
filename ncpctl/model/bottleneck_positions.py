"""The concept bottleneck's chunk arithmetic over a subset of positions (bottleneck.py).

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

from .bottleneck import _chunked


def _log_or_at(z: torch.Tensor, chunk: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Known logits (B, T, n), kept positions (B, T) bool -> (log k_chunk, log(1 - k_chunk)) per chunk
    (B, C, n) over the kept tokens, fp32, and which chunks hold one (B, C) bool. A chunk with none gets
    finite placeholder values (log 1/2 both; its caller drops it) and no gradient."""
    terms = torch.where(keep[..., None], F.logsigmoid(-z.float()), torch.zeros((), device=z.device))
    s = _chunked(terms, chunk).sum(dim=2)  # (B, C, n) log prod (1 - k_t) over the kept tokens
    has = _chunked(keep[..., None].float(), chunk).amax(dim=(2, 3)) > 0  # (B, C)
    s = torch.where(has[..., None], s.clamp_max(-1e-30), torch.full_like(s, -math.log(2)))
    # log(1 - exp(s)), stable on both sides of -ln 2 (bottleneck._log_or)
    log_p = torch.where(s > -math.log(2), torch.log(-torch.expm1(s)), torch.log1p(-torch.exp(s)))
    return log_p, s, has


def chunk_labels_at(labels: torch.Tensor, chunk: int, keep: torch.Tensor) -> torch.Tensor:
    """Token labels (B, T, n) -> chunk labels (B, C, n): the OR of the chunk's kept tokens' labels."""
    return _chunked(labels.float() * keep[..., None], chunk).amax(dim=2)


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
    return _chunked(labels.float(), block).amax(dim=2).repeat_interleave(block, dim=1)[:, :T]
