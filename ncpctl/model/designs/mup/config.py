"""The recipe keys of decoupled muP (DLCM Sec. 6.1, mup.py): the section ``ModelConfig`` composes
(``model.mup_base_width``, ``model.mup_base_concept_width``), its checks and the width
multipliers. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncpctl.model.core.config_base import Section, is_positive_int, option


@dataclass
class MupSection(Section):
    mup_base_width: int | None = option(
        None, "Decoupled muP (DLCM Sec. 6.1): the base width d_base the hyperparameters were tuned at; null = off "
        "(standard parametrization). s_token = d_model / d_base: token-module hidden matrices get init variance "
        "and AdamW lr and epsilon / s_token, the logits are divided by s_token; embeddings, norms, biases and the "
        "LM head keep the base init and lr; which matrix is hidden: docs/designs/dlcm.md, Decoupled muP.")
    mup_base_concept_width: int | None = option(
        None, "Decoupled muP: the concept transformer's base width; s_concept = d_concept / it scales the concept "
        "module's hidden matrices the same way; null = mup_base_width.")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        problems = []
        for name in ("mup_base_width", "mup_base_concept_width"):
            v = getattr(self, name)
            if v is not None and not is_positive_int(v):
                problems.append((name, f"must be a positive integer (a width) or null, got {v!r}"))
        if self.mup_base_concept_width is not None and self.mup_base_width is None:
            problems.append(("mup_base_concept_width", "decoupled muP is off (mup_base_width: null); set "
                                                       "mup_base_width too"))
        return problems

    @property
    def mup_widths(self) -> tuple[float, float] | None:
        """Decoupled muP's width multipliers (s_token, s_concept) = (d_model, d_concept) / their base
        widths (DLCM Sec. 6.1); None when ``mup_base_width`` is null (standard parametrization)."""
        if self.mup_base_width is None:
            return None
        base_c = self.mup_base_concept_width or self.mup_base_width
        return self.d_model / self.mup_base_width, self.concept_cfg.d_model / base_c
