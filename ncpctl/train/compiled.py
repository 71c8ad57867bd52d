"""``train.compile``: ``torch.compile`` of every block of every stack (regional compilation, as
torchtitan does per transformer block), not of the whole model: the blocks are the same few
graphs in every design (ConceptLM, NCP-ArchPreview, DLCM, the bottleneck) and hold nearly all the
compute, while what runs between them (DLCM's boundaries, the VQ codebook's nearest code, the
bottleneck's top-k) is data-dependent and stays eager. Each block keeps its name and parameters
(``nn.Module.compile`` compiles its call in place), so checkpoints are unchanged.

Where it cannot compile, the run goes on eagerly with one warning line saying why: ZeRO-3 (its
per-module hooks gather the weights around each forward, which torch.compile would trace as graph
breaks; DeepSpeed's own ``engine.compile`` is the route there) or, on a CPU, no C++ compiler for
inductor's kernels.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch
from torch import nn


def why_not(zero_stage: int, on_gpu: bool, backend: str = "inductor") -> str | None:
    """Why the blocks cannot be compiled here, or None."""
    if zero_stage == 3:
        return "ZeRO-3 gathers each module's weights in hooks around its forward, which torch.compile does not trace"
    if backend == "inductor" and not on_gpu and shutil.which(os.environ.get("CXX", "g++")) is None:
        return f"inductor needs a C++ compiler on the CPU and {os.environ.get('CXX', 'g++')} is not on PATH"
    return None


def compile_blocks(model: nn.Module, zero_stage: int, on_gpu: bool, warn: Callable[[str], None],
                   backend: str = "inductor") -> int:
    """Compile each block of every ``Stack`` of ``model`` in place with ``backend``; returns how
    many, or 0 after one ``warn`` line when ``why_not`` says it cannot."""
    from ncpctl.model.layers import Stack

    reason = why_not(zero_stage, on_gpu, backend)
    if reason is not None:
        warn(f"train.compile: running eagerly: {reason}")
        return 0
    blocks = [blk for stack in model.modules() if isinstance(stack, Stack) for blk in stack]
    for blk in blocks:
        blk.compile(backend=backend)
    # each block instance is its own frame: allow one compiled variant per block (and per shape)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(blocks))
    return len(blocks)
