"""The recipe keys of multi-token prediction (mtp.py): the section ``ModelConfig`` composes
(``model.mtp_depth``, ...) and its checks. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncpctl.model.core.config_base import Section, option


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


class MtpCost:
    """The cost model's view of the MTP head (mtp.py; training only: decoding and the export drop
    it): depth k on the T - k positions that have a target, proj (2d -> d), one full-attention
    layer and the shared LM head."""

    @staticmethod
    def flops(cfg: Any, T: int, layer: Any) -> dict[str, tuple[int, int | None]]:
        """key -> (forward, causal count or None); ``layer(n)``: one full-attention layer's counts
        on n positions (accounting_parts._stack_flops)."""
        d, out = cfg.d_model, {}
        for k in range(1, (cfg.mtp_depth or 0) + 1):
            n = T - k
            if n <= 0:
                break
            one = layer(n)
            parts = {"mtp.proj": (2 * n * 2 * d * d, None),
                     "mtp.layers": (one["qkv"] + one["attn_out"] + one["mlp"], None),
                     "mtp.attention": (one["attention"], one["attention_causal"]),
                     "mtp.lm_head": (2 * n * d * cfg.padded_vocab_size, None)}
            for key, (f, c) in parts.items():
                f0, c0 = out.get(key, (0, None if c is None else 0))
                out[key] = (f0 + f, None if c is None else c0 + c)
        return out

    @staticmethod
    def backward_factors(into: bool, head: bool, lm_weight: bool) -> dict[str, int]:
        """Backward = forward x factor per component. The head reads the final states (``into``:
        they carry a gradient) through its own norms; ``head``: a parameter of its own trains; proj
        and the layer's matmuls are linears, its attention weight-less (2x when its input carries a
        gradient), the shared LM head a linear whose weight (``lm_weight``) is the main head's."""
        inner = into or head
        return {"mtp.proj": inner + head, "mtp.layers": inner + head, "mtp.attention": 2 * inner,
                "mtp.lm_head": inner + lm_weight}
