"""The recipe keys of multi-token prediction (mtp.py): the section ``ModelConfig`` composes
(``model.mtp_depth``, ...) and its checks. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_base import Section, option


@dataclass
class MtpSection(Section):
    mtp_depth: int | None = option(
        None, "Multi-token prediction depths D (NCP-ArchPreview Sec. 5.2: 1, predicting t+2; ConceptLM Table 4's "
        "4-future-token baseline: 3, the main head predicting t+1); null = off. Training only: evaluation and export use the main head.")
    mtp_weight: float = option(0.3, "Weight of the mean MTP depth loss in the total loss (ArchPreview, DeepSeek-V3: 0.3).")
    mtp_weight_schedule: list = option(
        list, "[[from_step, weight], ...]: the MTP weight from each step on (DeepSeek-V3: 0.3, then 0.1).")
    mtp_stop_token: int | None = option(
        None, "End-of-document token id: an MTP shift across it is not scored (null: shifts cross documents).")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        problems = []
        if self.mtp_depth is not None and (not isinstance(self.mtp_depth, int) or self.mtp_depth < 1):
            problems.append(("mtp_depth", f"must be >= 1 (null turns MTP off), got {self.mtp_depth!r}"))
        sched = self.mtp_weight_schedule
        if not isinstance(sched, list) or not all(isinstance(x, list) and len(x) == 2 for x in sched):
            problems.append(("mtp_weight_schedule", f"must be a list of [from_step, weight] pairs, got {sched!r}"))
        return problems
