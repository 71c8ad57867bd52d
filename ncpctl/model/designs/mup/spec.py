"""The mup design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.mup.config import MupSection

SPEC = DesignSpec("mup", model_sections=(MupSection,))
