"""The bottleneck design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.bottleneck.config import BottleneckSection

SPEC = DesignSpec(
    "bottleneck",
    model_sections=(BottleneckSection,),
    hooks=("ncpctl.train.designs.bottleneck:BottleneckHooks",),
)
