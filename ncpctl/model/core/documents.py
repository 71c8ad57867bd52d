"""Packed documents (``data.document_mask``): which models can keep them apart, and the check of
the ``doc_ids`` a forward receives.

A training window packs several documents; ``doc_ids`` (B, T) long gives each position's document
(non-decreasing along a row). With it the model keeps documents apart everywhere tokens mix:
attention (every declared pattern becomes block-diagonal by document, patterns.py), positions
(RoPE and learned positions restart per document), concept segments (segment.py: fixed blocks are
counted from each document's start and a block cut by a document's end is dropped; DLCM starts a
segment at every document's first token), the concept stack (its attention and positions per
document) and the causal shift (a token gets its own document's closed concepts only), and the
MTP depths. Targets are untouched: the position of a document's last token (its EOD) still
predicts the next document's first token, as Megatron-LM and GPT-NeoX train.

Cached decoding holds one document per sequence and takes no ``doc_ids``.
"""

from __future__ import annotations

import torch

from ncpctl.model.core.config import ModelConfig, strategy


def document_refusal(cfg: ModelConfig) -> str | None:
    """Why a model of ``cfg`` cannot keep packed documents apart, or None: it can."""
    objective = strategy("objective", cfg.objective)
    if not getattr(objective, "causal", True):
        return (f"model.objective {cfg.objective}: its attention pattern lets a position see later ones, and its "
                "blocks are counted over the whole window; data.document_mask supports causal objectives only")
    if cfg.bottleneck.enabled:
        return ("model.bottleneck: its chunks and label evidence run over the whole window, across documents; "
                "data.document_mask does not support the concept bottleneck yet")
    if not cfg.concept.enabled:
        return None
    segmenter = strategy("segmentation", cfg.concept.segmentation)
    if not getattr(segmenter, "documents", False):
        return (f"model.concept.segmentation {cfg.concept.segmentation}: this segmenter does not take packed "
                "documents (Segmenter.documents)")
    coupling = strategy("coupling", cfg.concept.coupling)
    return coupling.document_refusal(cfg) if hasattr(coupling, "document_refusal") else None


def check_documents(model, idx: torch.Tensor, doc_ids: torch.Tensor) -> None:
    """``doc_ids`` must match ``idx`` (B, T) and the model must support documents (a ValueError)."""
    if doc_ids.shape != idx.shape or doc_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"doc_ids must be integer of the inputs' shape {tuple(idx.shape)}, got "
                         f"{doc_ids.dtype} {tuple(doc_ids.shape)}")
    why = document_refusal(model.cfg)
    if why is not None:
        raise ValueError(why)
