"""The causal_diffusion design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.causal_diffusion.config import DiffusionSection

SPEC = DesignSpec(
    "causal_diffusion",
    strategies={"objective": {"causal_diffusion": ".designs.causal_diffusion.module:CausalDiffusion"}},
    model_sections=(DiffusionSection,),
)
