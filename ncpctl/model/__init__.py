"""The NCP model: config (pure Python) and, imported lazily, the torch modules.

``import ncpctl.model`` or ``ncpctl.model.core.config`` does not import torch; ``NCPModel`` and
friends load on first access.

Rooms: ``core/`` (the config, layers, attention patterns, RoPE, the staged model, its concept path,
outputs and decoding), ``families/`` (the backbone families, one module each, and the HF mapping),
``designs/NAME/`` (one room per built-in design: its module, its config section with its cost and
law, and ``spec.py``, the ``DesignSpec`` that ``registry.DESIGNS`` registers by one line; the
strategy table, laws, costs, training hooks and config sections are derived from these records),
``accounting/`` (exact FLOPs, backward, memory and parameter counts), ``registry.py``.

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

from ncpctl.model.core.config import SIZES, ConceptConfig, ConfigError, ModelConfig, SegmentationLaw, build_config, option, register, unregister
from ncpctl.model.designs.bottleneck.config import BottleneckConfig
from ncpctl.model.core.outputs import LogKey, NCPOutput

_LAZY = {
    "NCPModel": "ncpctl.model.core.model",
    "DecodeState": "ncpctl.model.core.decode",
    "ConceptOutput": "ncpctl.model.core.concept",
    "Segmenter": "ncpctl.model.core.segment",
    "Segments": "ncpctl.model.core.segment",
    "Closing": "ncpctl.model.core.segment",
    "FixedBlocks": "ncpctl.model.core.segment",
    "segment_means": "ncpctl.model.core.segment",
    "DynamicSegmenter": "ncpctl.model.designs.dynamic.module",
    "Coupling": "ncpctl.model.core.coupling",
    "Residual": "ncpctl.model.core.layers",
    "Block": "ncpctl.model.core.layers",
    "Context": "ncpctl.model.core.layers",
    "Stack": "ncpctl.model.core.layers",
    "Intervention": "ncpctl.model.core.interventions",
    "CodeEdit": "ncpctl.model.core.interventions",
    "AddToDecoderInput": "ncpctl.model.core.interventions",
    "AddToResidual": "ncpctl.model.core.interventions",
    "Objective": "ncpctl.model.core.objective",
    "NextToken": "ncpctl.model.core.objective",
    "Decoding": "ncpctl.model.core.objective",
    "CachedDecoding": "ncpctl.model.core.objective",
    "Pattern": "ncpctl.model.core.patterns",
    "Causal": "ncpctl.model.core.patterns",
    "BlockCausal": "ncpctl.model.core.patterns",
    "Family": "ncpctl.model.families.base",
}

__all__ = ["SIZES", "BottleneckConfig", "ConceptConfig", "ConfigError", "ModelConfig", "SegmentationLaw", "build_config", "register",
           "option", "unregister",
           "LogKey", "NCPOutput", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
