"""The mtp design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec
from ncpctl.model.designs.mtp.config import MtpSection

SPEC = DesignSpec("mtp", model_sections=(MtpSection,))
