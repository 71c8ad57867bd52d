"""The concept codebook in a training run (``ncpctl.model.core.concept``; hooks: ``ncpctl.train.hooks``).

evaluation   with ``train.plots``, the final validation counts, per codebook segment, how often
             each code is the nearest code of a predicted concept (ConceptLM Fig. 5).
results      those counts for ``codebook_usage.png``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import DesignHooks


class CodebookHooks(DesignHooks):
    recipe_key = "train.plots (the codebook plots)"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self._model: torch.nn.Module | None = None
        self._counts: torch.Tensor | None = None  # (S, N) this rank's hits of the running final evaluation
        self.code_counts: np.ndarray | None = None  # (S, N) over every rank

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        return recipe.model_config.concept.enabled and recipe.train.plots

    def eval_begin(self, model: torch.nn.Module, final: bool) -> None:
        cfg = self.recipe.model_config
        self._model = model
        device = next(model.parameters()).device
        self._counts = torch.zeros(cfg.n_segments, cfg.concept.codes, device=device) if final else None

    def eval_micro(self, i: int, out: Any) -> None:
        if self._counts is not None and out.pred is not None:
            self._counts += code_hits(self._model, out.concept)

    def eval_end(self, d: Any) -> dict[str, float]:
        if self._counts is not None:
            self.code_counts = d.sum(self._counts.flatten()).view(self._counts.shape[0], -1).numpy()
        return {}

    def plots(self) -> dict[str, Any]:
        return {"code_counts": self.code_counts}


def code_hits(model: torch.nn.Module, co: Any) -> torch.Tensor:
    """(S, N) counts of the nearest code of each predicted concept ``co.pred`` (B, M, d), per
    segment; a row's padding concepts (``co.segments.valid`` false) are not counted."""
    import deepspeed

    from ncpctl.model.core.concept import nearest_code

    cb = model.concept.codebook
    with deepspeed.zero.GatheredParameters(list(cb.parameters())):  # no-op below ZeRO-3
        codes = cb().detach()  # (S, N, ds)
    idx = nearest_code(co.pred.detach(), codes).reshape(-1, codes.shape[0])  # (B*M, S)
    valid = co.segments.valid
    ones = torch.ones(idx.t().shape, device=idx.device)
    if valid is not None:
        ones = ones * valid.reshape(1, -1).to(ones.dtype)
    counts = codes.new_zeros(codes.shape[0], codes.shape[1], dtype=torch.float32)
    counts.scatter_add_(1, idx.t(), ones)
    return counts
