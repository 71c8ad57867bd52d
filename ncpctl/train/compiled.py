"""``train.compile``: ``torch.compile`` of every block of every stack (regional compilation, as
torchtitan does per transformer block), not of the whole model: the blocks are the same few
graphs in every design (ConceptLM, NCP-ArchPreview, DLCM, the bottleneck) and hold nearly all the
compute, while what runs between them (DLCM's boundaries, the VQ codebook's nearest code, the
bottleneck's top-k) is data-dependent and stays eager.

Only each block's ``forward`` is compiled, not its ``__call__``: module hooks run eagerly around
the compiled graph. That is what makes ZeRO-3 work: DeepSpeed gathers a module's weights in a
forward pre-hook and releases them in a post-hook (its hook functions are ``torch.compiler.disable``d,
so traced inside a graph they break it, and dynamo recompiled per sub-module type until its limit:
64 s for two debug steps with dynamo's ``eager`` backend, against 0.4 s eager). Each block is made a
ZeRO-3 *leaf* (``set_z3_leaf_module``): its hooks gather all of its weights at once, its
sub-modules get none, and the compiled forward is one graph over gathered weights. All blocks run
the same code, so blocks of one kind share one compiled graph (dynamo guards on a sub-module's
hooks, though: a hook registered per block is a recompile per block). The block keeps its name,
class and parameters, so checkpoints are unchanged.

The depth mixers between the blocks (IRC, CRC's connections, Block AttnRes: modules that set
``compile_region``) are compiled the same way: each is a few small elementwise kernels per layer
eagerly (the H200's IRC+CRC step cost 1.49x the plain one for 0.5% of its FLOPs), which inductor
fuses. Their ``forward(layer, ...)`` takes the layer index, so dynamo keeps one graph per layer.
Below ZeRO-3 only: a ZeRO-3 leaf gathers its weights around its ``forward``, and CRC normalises
its sources (``CrossModule.sources``) outside it, so at ZeRO-3 the mixers stay eager.

Where it cannot compile (on a CPU, no C++ compiler for inductor's kernels), the run goes on
eagerly with one warning line saying why.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch
from torch import nn


def why_not(on_gpu: bool, backend: str = "inductor") -> str | None:
    """Why the blocks cannot be compiled here, or None."""
    if backend == "inductor" and not on_gpu and shutil.which(os.environ.get("CXX", "g++")) is None:
        return f"inductor needs a C++ compiler on the CPU and {os.environ.get('CXX', 'g++')} is not on PATH"
    return None


def compile_blocks(model: nn.Module, zero_stage: int, on_gpu: bool, warn: Callable[[str], None],
                   backend: str = "inductor") -> int:
    """Compile the ``forward`` of each block of every ``Stack`` of ``model``, and of each module that
    sets ``compile_region`` (the depth mixers), in place with ``backend`` (before
    ``deepspeed.initialize``: at ZeRO-3 each becomes a leaf of its parameter hooks); returns how
    many, or 0 after one ``warn`` line when ``why_not`` says it cannot."""
    from ncpctl.model.core.layers import Stack

    reason = why_not(on_gpu, backend)
    if reason is not None:
        warn(f"train.compile: running eagerly: {reason}")
        return 0
    blocks = [blk for stack in model.modules() if isinstance(stack, Stack) for blk in stack]
    if zero_stage < 3:  # a mixer is not a ZeRO-3 leaf: CRC normalises its sources outside its forward
        blocks += [m for m in model.modules() if getattr(m, "compile_region", False)]
    for blk in blocks:
        if zero_stage == 3:
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(blk, True)
        blk.forward = torch.compile(blk.forward, backend=backend)
    # every block runs the same code (Block.forward): one compiled variant per kind of block (stack,
    # window, cross-attention) and per shape, a mixer's one per layer; the default limit (8) would
    # send the rest to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(blocks))
    return len(blocks)
