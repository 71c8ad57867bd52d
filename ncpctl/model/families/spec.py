"""The built-in backbone families' registration record (``registry.DESIGNS`` names it)."""

from __future__ import annotations

from ncpctl.model.core.config_base import DesignSpec

SPEC = DesignSpec(
    "families",
    strategies={"backbone": {"neox": ".families.neox:NeoX", "llama": ".families.llama:Llama", "gpt2": ".families.gpt2:GPT2"}},
)
