"""DLCM's compression metrics of a trained model (Table 5, Fig. 7), on token windows.

* ``loss_by_concept_position``: Fig. 7. The next-token loss of every scored token grouped by that
  token's position within its concept (1 = the first token of a segment), for positions
  1..``max_position`` (the paper: 20), under the DLCM model's inference boundaries (p >= the
  threshold, eval mode). With ``base``, the base model's loss on the same windows is grouped by the
  same positions (the DLCM model's boundaries: the base has none), and ``delta`` = DLCM - base per
  position (negative: DLCM better). Every row gives its sample count: the paper's figure has none,
  and the later positions hold few tokens.
* ``compression_by_source``: Table 5. Realised tokens per concept per corpus (e.g. one per
  ``data.sources`` entry, tokenized with the model's tokenizer) at the inference threshold:
  tokens / boundaries over all of a corpus's windows (the global ratio, not a mean of ratios).

Token ``x[t]`` (t >= 1) is scored from the logits at t - 1 and sits at position
``t - start(t) + 1`` of its segment, ``start(t)`` the last boundary at or before t (boundaries are
b_t = [p_t >= threshold], b_0 = 1: DLCM Sec. 3.3.1). Pure torch; the caller picks the windows
(validation windows of the run, or a held-out corpus's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from ncpctl.checkpoint import load_model
from ncpctl.data.meta import read as read_meta
from ncpctl.data.windows import SourceMap
from ncpctl.errors import UserError
from ncpctl.evaluate.heldout import check_labels, documents
from ncpctl.evaluate.offline import data_dir_for

__all__ = ["positions_in_concept", "loss_by_concept_position", "compression_by_source", "PositionLoss"]


def positions_in_concept(closed: torch.Tensor) -> torch.Tensor:
    """(B, T) 1-based position of each token within its segment, from the segment index of each
    token (``Segments.closed``: segments started at or before t, minus one)."""
    B, T = closed.shape
    start = torch.ones_like(closed, dtype=torch.bool)
    start[:, 1:] = closed[:, 1:] != closed[:, :-1]
    ar = torch.arange(T, device=closed.device).expand(B, T)
    last_start = torch.cummax(torch.where(start, ar, torch.zeros_like(ar)), dim=1).values  # (B, T)
    return ar - last_start + 1


def _boundaries(model: torch.nn.Module, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, Any]:
    """The model's inference segment index per token (B, T) (``Segments.closed``) and its logits
    (B, T, V) (None without ``logits``)."""
    out = model(x, compute_logits=logits)
    seg = out.concept.segments if out.concept is not None else None
    if seg is None or seg.closed is None:
        raise ValueError("loss_by_concept_position: the model has no data-dependent segments "
                         "(model.concept.segmentation: dynamic)")
    return seg.closed, out.logits


def _token_nll(logits: torch.Tensor, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, T-1) NLL of x[:, 1:] from logits[:, :-1] over the real vocabulary."""
    lg = logits[:, :-1, :vocab].float()
    return F.cross_entropy(lg.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)


@dataclass
class PositionLoss:
    """Fig. 7's rows: ``positions`` 1..max_position, the DLCM model's mean NLL at each, the base's
    (None without one), ``delta`` = dlcm - base, ``counts`` scored tokens per position, and the
    realised ``tokens_per_concept`` of the windows."""

    positions: list[int]
    dlcm: list[float]
    counts: list[int]
    tokens_per_concept: float
    base: list[float] | None = None
    delta: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: a position no token reached is null (not NaN)."""
        clean = lambda xs: None if xs is None else [None if v != v else v for v in xs]  # noqa: E731
        return {"positions": self.positions, "dlcm": clean(self.dlcm), "base": clean(self.base),
                "delta": clean(self.delta), "counts": self.counts, "tokens_per_concept": self.tokens_per_concept,
                **self.extra}


@torch.no_grad()
def loss_by_concept_position(model: torch.nn.Module, windows: Iterable[torch.Tensor], *,
                             base: torch.nn.Module | None = None, max_position: int = 20) -> PositionLoss:
    """Fig. 7 on ``windows`` (each (B, T) token ids, scored within the window). ``model``: a DLCM
    (dynamic segmentation); ``base``: a model without it, compared at the DLCM model's positions."""
    was = model.training, (base.training if base is not None else False)
    model.eval()
    if base is not None:
        base.eval()
    K = max_position
    sums, base_sums = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.long)
    tokens = boundaries = 0
    try:
        for x in windows:
            closed, logits = _boundaries(model, x)
            pos = positions_in_concept(closed)  # (B, T)
            tokens += closed.numel()
            boundaries += int((pos == 1).sum())
            p = pos[:, 1:].reshape(-1).cpu()  # the scored tokens x[:, 1:]
            keep = p <= K
            idx = p[keep] - 1
            vocab = model.cfg.vocab_size
            sums.index_add_(0, idx, _token_nll(logits, x, vocab).reshape(-1).cpu()[keep].double())
            counts.index_add_(0, idx, torch.ones_like(idx))
            if base is not None:
                nll = _token_nll(base(x).logits, x, base.cfg.vocab_size).reshape(-1).cpu()[keep].double()
                base_sums.index_add_(0, idx, nll)
    finally:
        model.train(was[0])
        if base is not None:
            base.train(was[1])
    mean = lambda s: [float(v / c) if c else float("nan") for v, c in zip(s, counts)]  # noqa: E731
    out = PositionLoss(positions=list(range(1, K + 1)), dlcm=mean(sums), counts=counts.tolist(),
                       tokens_per_concept=tokens / max(boundaries, 1))
    if base is not None:
        out.base = mean(base_sums)
        out.delta = [a - b for a, b in zip(out.dlcm, out.base)]
    return out


@torch.no_grad()
def compression_by_source(model: torch.nn.Module, corpora: dict[str, Iterable[torch.Tensor]]) -> dict[str, dict]:
    """Table 5: ``{name: {"tokens", "concepts", "tokens_per_concept"}}`` for each corpus's windows
    (each (B, T) token ids) at the model's inference boundaries."""
    was = model.training
    model.eval()
    out = {}
    try:
        for name, windows in corpora.items():
            tokens = concepts = 0
            for x in windows:
                closed, _ = _boundaries(model, x, logits=False)
                tokens += closed.numel()
                concepts += int((positions_in_concept(closed) == 1).sum())
            out[name] = {"tokens": tokens, "concepts": concepts, "tokens_per_concept": tokens / max(concepts, 1)}
    finally:
        model.train(was)
    return out


def _windows(ids: list[int], T: int, max_windows: int, batch: int) -> list[torch.Tensor]:
    """Non-overlapping (b, T) windows of a token stream, at most ``max_windows`` in all; a
    stream shorter than T gives one window of its length."""
    n = min(max(len(ids) // T, 1 if ids else 0), max_windows)
    T = T if len(ids) >= T else len(ids)
    rows = torch.tensor(ids[: n * T], dtype=torch.long).view(n, T) if n else torch.zeros(0, T, dtype=torch.long)
    return list(rows.split(batch)) if n else []


def validation_corpora(target: Any, T: int, max_windows: int, batch: int) -> dict[str, list[torch.Tensor]]:
    """The checkpoint's own validation split as one corpus per ``data.sources`` entry (its
    documents are stored in source order, counted per source in meta.json): ``{source label:
    windows}``, each source's token stream cut like a held-out corpus's."""
    from ncpctl.data.indexed import IndexedDataset

    data, _ = data_dir_for(str(target))
    meta_path = data / "meta.json"
    meta = read_meta(meta_path) or {}
    counts = ((meta.get("splits") or {}).get("val") or {}).get("documents_per_source")
    if counts is None or meta.get("source_labels") is None:
        raise UserError(f"{meta_path}: no validation documents per source (tokenized by an earlier ncpctl)",
                        hint="re-tokenize with `ncpctl tokenize --force RECIPE`, or pass --heldout corpora")
    ds = IndexedDataset(data / "val")
    smap = SourceMap(ds, counts, meta["source_labels"])
    return {label: _windows(ds.tokens[a:min(b, a + max_windows * T)].astype(np.int64).tolist(), T, max_windows, batch)
            for label, (a, b) in zip(smap.labels, smap.ranges()) if b > a}


def concept_report(target: Any, specs: list[Any], *, base: Any = None, seq_len: int | None = None,
                   max_windows: int = 600, max_position: int = 20, batch: int = 8) -> dict[str, Any]:
    """``ncpctl eval TARGET --concepts``: Table 5 (tokens per concept per held-out corpus, e.g. one
    per ``data.sources`` entry) and Fig. 7 (loss by position within the concept over all of them,
    against ``base``) for the DLCM checkpoint ``target``. Each corpus (``HeldoutSource``: the syntax
    of a ``data.sources`` entry) is read and tokenized with the checkpoint's tokenizer, documents
    joined by the end-of-document token, cut into at most ``max_windows`` windows of ``seq_len``
    (default: the model's max_seq_len; the paper: 600 validation samples). No ``specs``: the
    checkpoint's validation split, one corpus per ``data.sources`` entry (``validation_corpora``)."""
    lm = load_model(target)
    c, law = lm.config.concept, lm.config.law
    if not (law is not None and law.variable_length):  # learned boundaries: DLCM's dynamic segmentation
        raise UserError(f"{target}: --concepts needs a model with model.concept.segmentation: dynamic (DLCM)")
    if lm.tokenizer is None:
        raise UserError(f"{lm.path}: the checkpoint has no tokenizer.json")
    ref = load_model(base, with_tokenizer=False) if base is not None else None
    if ref is not None and ref.config.vocab_size != lm.config.vocab_size:
        raise UserError(f"--base {base}: vocabulary {ref.config.vocab_size} differs from {lm.config.vocab_size}",
                        hint="compare models trained with the same tokenizer")
    labels = check_labels(specs, [])
    T = min(seq_len or lm.config.max_seq_len, lm.config.max_seq_len)
    eod = (lm.meta.get("recipe") or {}).get("tokenizer", {}).get("eod_token", "<|endoftext|>")
    eod_id = lm.tokenizer.token_to_id(eod)
    corpora = validation_corpora(target, T, max_windows, batch) if not specs else {}
    for spec, label in zip(specs, labels):
        ids: list[int] = []
        for row in documents(spec, lm.tokenizer):
            ids += lm.tokenizer.encode(row["text"], add_special_tokens=False).ids + ([eod_id] if eod_id is not None else [])
        corpora[label] = _windows(ids, T, max_windows, batch)
    by_source = compression_by_source(lm.model, corpora)
    every = [x for xs in corpora.values() for x in xs]
    fig7 = loss_by_concept_position(lm.model, every, base=ref.model if ref else None, max_position=max_position)
    return {"checkpoint": str(lm.path), "base": str(ref.path) if ref else None, "seq_len": T,
            "corpora": "held-out" if specs else "validation split, per data.sources entry",
            "target_ratio": c.target_ratio, "threshold": c.boundary_threshold,
            "tokens_per_concept_by_source": by_source, "loss_by_concept_position": fig7.to_dict()}
