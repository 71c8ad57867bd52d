"""The residual design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.residual.config import AttnResSection, CrcSection, IrcSection

SPEC = DesignSpec(
    "residual",
    strategies={"residual": {"irc": ".designs.residual.module:IRC", "block_attnres": ".designs.residual.module:BlockAttnRes"}},
    costs={("residual", "irc"): ".designs.residual.config:IrcCost",
           ("residual", "block_attnres"): ".designs.residual.config:AttnResCost"},
    model_sections=(AttnResSection, CrcSection, IrcSection),
)
