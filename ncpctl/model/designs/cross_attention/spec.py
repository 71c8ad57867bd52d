"""The cross_attention design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.cross_attention.config import CrossAttentionSection

SPEC = DesignSpec(
    "cross_attention",
    strategies={"coupling": {"cross_attention": ".designs.cross_attention.module:CrossAttentionCoupling"}},
    costs={("coupling", "cross_attention"): ".designs.cross_attention.config:Cost"},
    concept_sections=(CrossAttentionSection,),
    modes=("per_concept", "replicated"),
)
