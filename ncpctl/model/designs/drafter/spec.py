"""The drafter design's registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec

SPEC = DesignSpec("drafter", hooks=("ncpctl.train.designs.drafter:DrafterHooks",))
