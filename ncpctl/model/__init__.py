"""The NCP model: config (pure Python) and, imported lazily, the torch modules.

``import ncpctl.model`` or ``ncpctl.model.config`` does not import torch; ``NCPModel`` and
friends load on first access.
"""

from __future__ import annotations

from typing import Any

from ncpctl.model.config import SIZES, ConceptConfig, ConfigError, ModelConfig, build_config

_LAZY = {
    "NCPModel": "ncpctl.model.model",
    "NCPOutput": "ncpctl.model.model",
    "DecodeState": "ncpctl.model.decode",
}

__all__ = ["SIZES", "ConceptConfig", "ConfigError", "ModelConfig", "build_config", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
