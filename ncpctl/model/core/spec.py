"""The registration records of what the base model provides at each extension point (ConceptLM's
fixed blocks and addition, the plain residual, next-token prediction) and of its own training hooks
(the codebook's usage, packed documents): built in like the designs, through ``registry.DESIGNS``."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec, SegmentationLaw
from ncpctl.model.core.config_concept_head import ConceptHeadSection

# Fixed blocks of k tokens (ConceptLM): a trailing partial block is not pooled.
FIXED_BLOCKS = SegmentationLaw(concepts=lambda c, T: T // c.k, tokens_per_concept=lambda c: float(c.k),
                               length_key="k", pools_any_width=True)

CONCEPT = DesignSpec(
    "concept",
    strategies={"segmentation": {"fixed": ".core.segment:FixedBlocks"}, "coupling": {"add": ".core.coupling:AddCoupling"}},
    laws={"fixed": FIXED_BLOCKS},
    concept_sections=(ConceptHeadSection,),
    hooks=("ncpctl.train.designs.codebook:CodebookHooks",),
)
DOCUMENTS = DesignSpec("documents", hooks=("ncpctl.train.designs.documents:DocumentHooks",))
BASE = DesignSpec(
    "base",
    strategies={"residual": {"plain": ".core.layers:PlainResidual"}, "objective": {"next_token": ".core.objective:NextToken"}},
)
