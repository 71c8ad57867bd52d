"""``train.activation_checkpointing``: keep fewer activations for the backward pass and recompute
the rest (``torch.utils.checkpoint``, non-reentrant), applied to the model from outside, as
torchtitan does: the model's modules stay plain ``nn.Module``s and know nothing of it.

* ``none``: every activation is kept.
* ``full``: each block (every layer of every ``Stack``: the token encoder and decoder, the concept
  layers, DLCM's and the bottleneck model's backbones, MTP's) keeps only its input x (B, T, d) and
  runs its whole forward again in the backward pass: one more forward of the blocks per step.
* ``selective``: inside each block, the attention, cross-attention and MLP sub-layers keep only
  their inputs; their internals (q, k, v (B, H, T, hd), the attention output, the MLP's hidden
  (B, T, ffn)) are recomputed, the block's outputs and the residual stream are kept.

What runs between blocks (the depth mixers of IRC/CRC, DLCM's boundary predictor and pooling, the
VQ codebook, the bottleneck with its dropout, the heads) runs once, so nothing stateful is run
twice; the recomputed parts are pure functions of their inputs and weights (no dropout; the RNG
state is restored for the recomputation all the same). Decoding (no gradient, a KV cache) runs
them as usual.

The swap is of the module's class for a subclass whose ``forward`` checkpoints the original one:
parameter names, the state dict and ``isinstance`` are unchanged (checkpoints, Muon's matrices,
LoRA), a deep copy stays a checkpointed copy, and ZeRO-3's per-module hooks gather the weights
again in the recomputation (each sub-module is called through its ``__call__``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")
_SUBCLASSES: dict[type, type] = {}


def _is_cache(a: Any) -> bool:
    from ncpctl.model.core.layers import KVCache, RowsCache

    return isinstance(a, (KVCache, RowsCache))


def recomputed(cls: type) -> type:
    """``cls`` with a ``forward`` that runs under ``torch.utils.checkpoint`` while gradients are
    recorded (and no cache is written); one subclass per class."""
    if getattr(cls, "recomputed", False):
        return cls
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            inner = super(sub, self).forward
            if not torch.is_grad_enabled() or any(map(_is_cache, (*args, *kwargs.values()))):
                return inner(*args, **kwargs)
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

        sub = type(cls.__name__, (cls,), {"forward": forward, "recomputed": True, "__module__": cls.__module__,
                                          "__qualname__": f"{cls.__qualname__}[recomputed]"})
        _SUBCLASSES[cls] = sub
    return _SUBCLASSES[cls]


def checkpointed_modules(model: nn.Module, mode: str) -> list[nn.Module]:
    """The modules ``mode`` runs under checkpoint: the blocks of every stack (``full``) or their
    attention, cross-attention and MLP sub-layers (``selective``); none for ``none``."""
    from ncpctl.model.core.layers import Stack

    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: one of {', '.join(MODES)}")
    blocks = [blk for stack in model.modules() if isinstance(stack, Stack) for blk in stack]
    if mode == "full":
        return blocks
    if mode == "selective":
        return [sub for blk in blocks for sub in (blk.attn, getattr(blk, "cross", None), blk.mlp) if sub is not None]
    return []


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Swap the class of each module ``mode`` checkpoints (``checkpointed_modules``); returns how
    many. A mode applied before is undone first (no checkpoint nested in another); ``none`` only undoes."""
    mods = checkpointed_modules(model, mode)
    for m in model.modules():
        if type(m).__dict__.get("recomputed", False):
            m.__class__ = type(m).__bases__[0]
    for m in mods:
        m.__class__ = recomputed(type(m))
    return len(mods)
