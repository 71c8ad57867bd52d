"""Steerling's concept bottleneck in a training run (``ncpctl.model.designs.bottleneck.module``; hooks:
``ncpctl.train.hooks``).

prepare      each split's concept labels (``PREFIX.labels.npy``, ncpctl.data.labels) for its
             loader (with data.mix: each component's own), checked against
             ``model.bottleneck.concepts`` and one label vocabulary for every dataset and, under
             teacher forcing, refused when document-level; a steering stage's lift tokens from the
             train split (every labelled component of a mixture).
inputs       each micro-batch's label evidence as ``concept_labels`` (validation: the bottleneck's
             parts too, ``return_bottleneck``).
evaluation   held-out concept detection: the known head's chunk probabilities against the chunk
             labels, gathered over ranks, scored by ``concept_auc``.
results      the label vocabulary as the checkpoint's ``concept_names``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import DesignHooks, dataset_meta, micro_split


class BottleneckHooks(DesignHooks):
    recipe_key = "model.bottleneck"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.names: list[str] | None = None  # the label vocabulary (meta.json), the checkpoint's concept_names
        self._labels: list[torch.Tensor] = []  # the validation batch's labels per micro-batch (CPU)
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (chunk scores, chunk labels) per micro-batch

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        return recipe.model_config.bottleneck.enabled

    def loader_args(self, split: str, ds: Any, info: Callable[[str], None]) -> dict[str, Any]:
        spans, names = labels(self.recipe, ds)
        if names is not None and self.names is not None and names != self.names:
            # a label id means one concept in every dataset the run reads (a mixture's components, val)
            raise UserError(f"{dataset_meta(ds)[0]}: the label vocabulary differs from the first train dataset's "
                            f"({len(names)} names, {names[:3]}... vs {self.names[:3]}...)",
                            hint="tokenize the datasets together (data.mix components with sources share one "
                                 "vocabulary), or relabel them with one vocabulary")
        if split == "train" and self.names is None:
            self.names = names
        return {"labels": spans}

    def prepare(self, model: torch.nn.Module, *, train_ds: Any, loader: Any, info: Callable[[str], None]) -> None:
        set_lift_tokens(model, self.recipe, train_ds, loader, self.names, info)

    def inputs(self, loader: Any, micro: int, evaluating: bool) -> list[dict[str, Any]] | None:
        evidence = loader.last_labels()
        if evidence is None:
            self._labels = []
            return None
        self._labels = micro_split(evidence, micro)
        extra = {"return_bottleneck": True} if evaluating else {}
        return [{"concept_labels": lab, **extra} for lab in self._labels]

    def eval_begin(self, model: torch.nn.Module, final: bool) -> None:
        self._parts = []

    def eval_micro(self, i: int, out: Any) -> None:
        if self._labels:
            self._parts.append(chunk_detection(self.recipe.model_config, out, self._labels[i]))

    def eval_end(self, d: Any) -> dict[str, float]:
        return detection_auc(self._parts, d) if self._parts else {}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"concept_names": self.names}


def labels(recipe: Recipe, ds: Any) -> tuple[Any, list[str] | None]:
    """The concept labels of ``ds`` (``PREFIX.labels.npy``, ncpctl.data.labels): (LabelSpans, the
    vocabulary from meta.json or None). The bottleneck's ``concepts`` must equal the vocabulary's
    size, and teacher forcing is refused on document-level labels (``check_teacher_forcing``)."""
    from ncpctl.data.labels import LabelSpans

    b = recipe.model_config.bottleneck
    prefix = str(ds.bin_path)[: -len(".bin")]
    meta_path, meta = dataset_meta(ds)
    names = None
    if meta is not None:
        found = meta.get("labels") or {}
        names = found.get("vocabulary")
        if names is None:
            raise UserError(f"{meta_path}: the dataset has no concept labels, but model.bottleneck is on",
                            hint="set data.labels (python-ast or field) and run `ncpctl tokenize` again")
        if len(names) != b.concepts:
            raise UserError(f"model.bottleneck.concepts: {b.concepts}, but the dataset's label vocabulary has "
                            f"{len(names)} names ({meta_path})", hint=f"set model.bottleneck.concepts={len(names)}")
        check_teacher_forcing(recipe, found, meta_path)
    return LabelSpans(prefix, ds.num_tokens, b.concepts), names


def check_teacher_forcing(recipe: Recipe, meta: dict[str, Any], meta_path: Path) -> None:
    """Teacher forcing feeds a position the labels of the chunk before it (ncpctl.model.designs.bottleneck.module.
    fed_labels); a document-level label sits on every token of its document, so feeding it shows
    each position its document's future: refused. A ``field`` dataset from before
    ``labels.document_level`` was recorded may hold them: refused too, until it is tokenized again."""
    b = recipe.model_config.bottleneck
    if b.teacher_forcing_start == 0 and b.teacher_forcing_end == 0:
        return
    doc = meta.get("document_level")
    if doc is None and meta.get("labeller") == "field":
        doc = ["(unknown: this dataset predates labels.document_level)"]
    if doc:
        raise UserError(f"{meta_path}: teacher forcing with document-level labels ({', '.join(doc[:6])}"
                        f"{', ...' if len(doc) > 6 else ''}) would show every position its document's future",
                        hint="set model.bottleneck.teacher_forcing_start=0 and teacher_forcing_end=0 (they stay "
                             "concept-loss targets), give the labels as spans, or run `ncpctl tokenize` again")


def set_lift_tokens(model: torch.nn.Module, recipe: Recipe, ds: Any, loader: Any, names: list[str] | None,
                    info: Callable[[str], None]) -> None:
    """A steering stage's lift tokens T_c (L_express), from the train split's labels: derived
    from the data at every start, fresh or resumed, so a resume sees the same ones."""
    bn = model.bottleneck
    if bn.bcfg.express_weight <= 0:
        return
    from ncpctl.data.labels import lift_tokens

    # (tokens, labels) of the train split, or of each labelled data.mix component (their counts added)
    lift = lift_tokens(loader.label_streams(), bn.bcfg.lift_tokens, recipe.model_config.vocab_size)
    bn.lift = torch.from_numpy(lift)
    empty = [names[c] if names else str(c) for c in range(lift.shape[0]) if lift[c, 0] < 0]
    info(f"steering stage: {bn.bcfg.lift_tokens} lift tokens per concept from the train split's labels"
         + (f" (none for {', '.join(empty)}: no express loss there)" if empty else ""))


def chunk_detection(cfg: Any, o: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out concept detection of one micro-batch: the known head's chunk probabilities (the OR
    over a chunk's tokens) against the chunk labels, both (B * chunks, n), on the CPU. Where the
    objective reads the concepts at some positions only (``BottleneckOutput.positions``: a Causal
    Diffusion LM's masked tokens), the OR over those, of the chunks that hold one, as its concept loss."""
    from ncpctl.model.designs.bottleneck.chunks import chunk_labels, chunk_probs
    from ncpctl.model.designs.bottleneck.chunks import chunk_detection_at

    chunk = cfg.bottleneck.chunk
    keep = o.bottleneck.positions
    if keep is not None:
        scores, labels = chunk_detection_at(o.bottleneck.k_logits.float(), labels.to(keep.device), chunk, keep)
        return scores.cpu(), labels.cpu()
    scores = chunk_probs(o.bottleneck.k_logits.float(), chunk).cpu()
    return scores.reshape(-1, scores.shape[-1]), chunk_labels(labels.float(), chunk).reshape(-1, scores.shape[-1])


def detection_auc(parts: list[tuple[torch.Tensor, torch.Tensor]], d: Any) -> dict[str, float]:
    """The held-out detection keys (``ncpctl.model.designs.bottleneck.module.concept_auc``: the macro AUC with its
    interval, the pooled AUC beside its base rate) over every rank's chunks: AUC does not decompose
    over shards, so the (chunks, n) scores and labels of all ranks are gathered (zero-padded blocks,
    one sum) and every rank scores the whole split."""
    from ncpctl.model.designs.bottleneck.module import concept_auc

    scores, labels = torch.cat([s for s, _ in parts]), torch.cat([lab for _, lab in parts])
    if d.world > 1:
        rows = int(d.max(torch.tensor([scores.shape[0]], dtype=torch.float64)).item())
        counts = torch.zeros(d.world, dtype=torch.float64)
        counts[d.rank] = scores.shape[0]
        counts = d.sum(counts).long().tolist()
        # fp32, as the scores are (a sum with zeros is exact); Dist.sum hands back float64
        block = torch.zeros(d.world, rows, 2, scores.shape[1])
        block[d.rank, : scores.shape[0]] = torch.stack([scores.float(), labels.float()], 1)
        block = d.sum(block.flatten()).float().view(d.world, rows, 2, -1)
        both = torch.cat([block[r, :c] for r, c in enumerate(counts)])
        scores, labels = both[:, 0], both[:, 1]
    return concept_auc(scores, labels)
