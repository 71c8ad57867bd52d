"""Packed documents kept apart (``data.document_mask``; ncpctl.model.core.documents) in a training run
(hooks: ``ncpctl.train.hooks``).

prepare      refuses, before any heavy work, a model that cannot keep documents apart (a
             non-causal objective, the concept bottleneck).
inputs       each micro-batch's per-token document index (B, T) as ``doc_ids``, from the dataset's
             index (``WindowLoader.documents``; a data.mix component's own index), in training and
             validation alike.
"""

from __future__ import annotations

from typing import Any

from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import DesignHooks, micro_split


class DocumentHooks(DesignHooks):
    recipe_key = "data.document_mask"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        from ncpctl.model.core.documents import document_refusal

        why = document_refusal(recipe.model_config)
        if why is not None:
            raise UserError(f"{recipe.path}: data.document_mask: {why}",
                            hint="set data.document_mask: false, or change the model")

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        return bool(recipe.data.document_mask)

    def inputs(self, loader: Any, micro: int, evaluating: bool) -> list[dict[str, Any]] | None:
        docs = loader.last_documents()
        return None if docs is None else [{"doc_ids": d} for d in micro_split(docs, micro)]
