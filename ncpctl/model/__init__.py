"""The NCP model: config (pure Python) and, imported lazily, the torch modules.

``import ncpctl.model`` or ``ncpctl.model.config`` does not import torch; ``NCPModel`` and
friends load on first access.

Extension points (docs/architecture.md): a segmentation (subclass ``Segmenter``), a coupling
(``Coupling``), a depth mixer (``Residual``), a training objective (``Objective``, declaring
its attention ``Pattern``: ``Causal``, ``BlockCausal``, ...) or a backbone family (``Family``:
defaults, norm and MLP, HF mapping) is registered by name with ``register(kind, name, cls)`` and
chosen with the recipe keys ``model.concept.segmentation``, ``model.concept.coupling``,
``model.residual``, ``model.objective`` and ``model.backbone`` (or named there as
``package.module:Class``); a registered design declares its own recipe keys as a dataclass of
``option`` fields named by its class attribute ``options`` (recipe ``model.options.NAME.KEY``,
read back with ``cfg.design_options(kind)``);
``interventions`` (``CodeEdit``, ``AddToDecoderInput``, ``AddToResidual``) edit a forward and
incremental decoding alike.
"""

from __future__ import annotations

from typing import Any

from ncpctl.model.config import (
    SIZES, BottleneckConfig, ConceptConfig, ConfigError, ModelConfig, SegmentationLaw, build_config, option, register,
    unregister,
)
from ncpctl.model.outputs import LogKey, NCPOutput

_LAZY = {
    "NCPModel": "ncpctl.model.model",
    "DecodeState": "ncpctl.model.decode",
    "ConceptOutput": "ncpctl.model.concept",
    "Segmenter": "ncpctl.model.segment",
    "Segments": "ncpctl.model.segment",
    "Closing": "ncpctl.model.segment",
    "FixedBlocks": "ncpctl.model.segment",
    "segment_means": "ncpctl.model.segment",
    "DynamicSegmenter": "ncpctl.model.dynamic",
    "Coupling": "ncpctl.model.coupling",
    "Residual": "ncpctl.model.layers",
    "Block": "ncpctl.model.layers",
    "Context": "ncpctl.model.layers",
    "Stack": "ncpctl.model.layers",
    "Intervention": "ncpctl.model.interventions",
    "CodeEdit": "ncpctl.model.interventions",
    "AddToDecoderInput": "ncpctl.model.interventions",
    "AddToResidual": "ncpctl.model.interventions",
    "Objective": "ncpctl.model.objective",
    "NextToken": "ncpctl.model.objective",
    "Decoding": "ncpctl.model.objective",
    "CachedDecoding": "ncpctl.model.objective",
    "Pattern": "ncpctl.model.patterns",
    "Causal": "ncpctl.model.patterns",
    "BlockCausal": "ncpctl.model.patterns",
    "Family": "ncpctl.model.family",
}

__all__ = ["SIZES", "BottleneckConfig", "ConceptConfig", "ConfigError", "ModelConfig", "SegmentationLaw", "build_config", "register",
           "option", "unregister",
           "LogKey", "NCPOutput", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
