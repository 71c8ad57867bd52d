"""DLCM's learned (dynamic) segments in a training run (``ncpctl.model.designs.dynamic.module``; hooks:
``ncpctl.train.hooks``).

prepare      the validation split's token sources (``SourceMap`` from meta.json's
             ``documents_per_source``) for its loader, when the dataset records them (not with
             data.mix, validated per component: tokens per concept per component instead).
evaluation   tokens per concept per source (DLCM Table 5): the concepts started and the tokens
             of each source over the whole split, summed over ranks: ``tokens_per_concept/{source}``.
results      the compression plot's target ratio R.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ncpctl.data.windows import SourceMap
from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import DesignHooks, dataset_meta, micro_split


class DynamicHooks(DesignHooks):
    recipe_key = "model.concept.segmentation: dynamic"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.sources: SourceMap | None = None  # the validation split's
        self._src: list[torch.Tensor] = []  # the validation batch's token sources per micro-batch (CPU)
        self._by_source: torch.Tensor | None = None  # (2, sources): concepts started, tokens

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        c = recipe.model_config.concept
        return c.enabled and c.segmentation == "dynamic"

    def loader_args(self, split: str, ds: Any, info: Callable[[str], None]) -> dict[str, Any]:
        r = self.recipe
        if split != "val" or (r.data.mix and not r.data.train_prefix):  # per component (validate.py) instead
            return {}
        if self.sources is None:
            self.sources = val_sources(ds, info)
        return {} if self.sources is None else {"sources": self.sources}

    def inputs(self, loader: Any, micro: int, evaluating: bool) -> list[dict[str, Any]] | None:
        found = loader.last_sources() if evaluating else None
        self._src = [] if found is None else micro_split(found, micro)
        return None

    def eval_begin(self, model: torch.nn.Module, final: bool) -> None:
        self._by_source = None if self.sources is None else torch.zeros(2, len(self.sources.labels), dtype=torch.long)

    def eval_micro(self, i: int, out: Any) -> None:
        if self._by_source is not None:
            self._by_source += source_counts(out, self._src[i], self._by_source.shape[1])

    def eval_end(self, d: Any) -> dict[str, float]:
        if self._by_source is None:
            return {}
        concepts, tokens = d.sum(self._by_source.to(d.device)).tolist()
        return {f"tokens_per_concept/{name}": n / c for name, c, n in zip(self.sources.labels, concepts, tokens) if n > 0}

    def plots(self) -> dict[str, Any]:
        return {"target_ratio": self.recipe.model_config.concept.target_ratio}


def val_sources(ds: Any, info: Callable[[str], None]) -> SourceMap | None:
    """Which ``data.sources`` entry each validation token is from, so validation reports tokens per
    concept per source (DLCM Table 5), from the split's ``documents_per_source`` in meta.json. None
    (and a note why) when the dataset does not say (a ``data.val_prefix`` made elsewhere, or
    tokenized by an earlier ncpctl: ``ncpctl tokenize --force`` adds the counts)."""
    meta_path, meta = dataset_meta(ds)
    meta = meta or {}
    counts = (meta.get("splits") or {}).get("val", {}).get("documents_per_source")
    labels = meta.get("source_labels")
    why = None
    if counts is None or labels is None:
        why = f"{meta_path} does not count documents per source" if meta else f"no {meta_path}"
    else:
        try:
            return SourceMap(ds, counts, labels)
        except ValueError as e:
            why = str(e)
    info(f"validation: no tokens per concept per source ({why})")
    return None


def source_counts(o: Any, sources: torch.Tensor, n: int) -> torch.Tensor:
    """(2, n) long: the concepts started (segment starts, b_t = 1) and the tokens of one
    micro-batch per source, from its inference segments (``Segments.closed`` (micro, T)) and each
    token's source (micro, T); tokens / concepts per source is validation's tokens per concept
    there (the global ratio, as DLCM Table 5, not a mean of window ratios)."""
    from ncpctl.evaluate.concept_position import positions_in_concept

    starts = (positions_in_concept(o.concept.segments.closed) == 1).long().cpu().flatten()
    src = sources.flatten()
    return torch.stack([torch.zeros(n, dtype=torch.long).index_add_(0, src, starts),
                        torch.bincount(src, minlength=n)])
