"""The dynamic design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.dynamic.config import DYNAMIC, DynamicSection

SPEC = DesignSpec(
    "dynamic",
    strategies={"segmentation": {"dynamic": ".designs.dynamic.module:DynamicSegmenter"}},
    laws={"dynamic": DYNAMIC},
    costs={("segmentation", "dynamic"): ".designs.dynamic.config:Cost"},
    concept_sections=(DynamicSection,),
    hooks=("ncpctl.train.designs.dynamic:DynamicHooks",),
    modes=("predictor", "boundary"),
)
