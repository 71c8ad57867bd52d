"""The recipe key of ``coupling: cross_attention`` (DLCM's token-to-concept cross-attention,
coupling.py): the section ``ConceptConfig`` composes (``model.concept.cross_attention``) and its
check. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from ncpctl.model.core.config_base import Section, option

COUPLING = "cross_attention"  # the coupling whose key this is (STRATEGIES["coupling"])
FORMS = ("per_concept", "replicated")
# ``concept.cross_attention: auto`` took the faster form of the machine where a run started, so one
# recipe trained different functions on a laptop and on a cluster. It resolved where the config was
# made, so no checkpoint or resolved recipe holds it: only a hand-written recipe can.
_NO_AUTO = ("auto is no longer a value: per_concept (DLCM Eq. 14, the default) and replicated (Sec. 4.1) are "
            "different functions, so the recipe names one (a checkpoint made with auto recorded the one it was "
            "trained as: its recipe.resolved.yaml)")


@dataclass
class CrossAttentionSection(Section):
    cross_attention: Literal["per_concept", "replicated"] = option(
        "per_concept", "coupling: cross_attention: which function the token-to-concept attention is (ncp-model.md "
        "section 8). per_concept = DLCM Eq. 14: a softmax over the closed concepts, each once; replicated = DLCM "
        "Sec. 4.1's kernel taken as the function: each concept's key/value copied onto the tokens of the next "
        "segment under a causal mask, so a concept weighs by its visible copies. The recipe chooses the function, "
        "the same on every machine; the device only picks the kernel that computes it (per_concept: SDPA with a "
        "(T, M) boolean mask, a fused masked kernel on a GPU; replicated: one is_causal SDPA, flash on a GPU).")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        if not self.enabled:
            return []
        if self.cross_attention == "auto":  # the machine chose the function
            return [("cross_attention", _NO_AUTO)]
        if self.cross_attention not in FORMS:
            return [("cross_attention", f"must be one of {', '.join(FORMS)}, got {self.cross_attention!r}")]
        return []

    def section_settle(self, cfg: Any) -> list[tuple[str, str]]:
        if not self.enabled or self.coupling != COUPLING:  # unused: one value, whatever a checkpoint recorded
            self.cross_attention = FORMS[0]
        return []


# the extra query/key coordinates of the replicated form (coupling.py's _PAD): its keys and values
# are head_dim + PAD wide
PAD = 8


class Cost:
    """The cost model's view of ``coupling: cross_attention`` (accounting.py asks ``design_cost``):
    W_Q, W_O on the T tokens, W_K, W_V on the M concepts, and the scores and weighted sum (SDPA
    computes the masked entries too): (T, M) per head for ``per_concept``; for ``replicated`` one
    causal attention over the T token-aligned copies, each head hd + PAD wide."""

    @staticmethod
    def flops(cfg: Any, T: int, M: int) -> dict[str, int]:
        d = cfg.d_model
        if cfg.concept.cross_attention == "replicated":
            attention = 2 * (2 * T * T * (d + PAD * cfg.n_heads))
        else:
            attention = 2 * (2 * T * M * d)
        return {"concept.cross_attention": 2 * (2 * T * d * d) + 2 * M * d * 2 * d + attention}

    @staticmethod
    def backward(cfg: Any, T: int, M: int, fwd: dict[str, int], grads_in: bool,
                 trains: Callable[[str], bool]) -> dict[str, int]:
        """As a linear of its forward F: F for the input gradients when the tokens or the concepts
        carry one (``grads_in``), F for the weight gradients when its projections train (exact when
        both or neither hold, as in every shipped stage)."""
        f = fwd["concept.cross_attention"]
        return {"concept.cross_attention": f * (grads_in + trains(""))}
