"""The LM head and next-token loss, fused for training (spec section 4: ``lm_head`` + NTP).

At Pythia's vocabulary the logits (N, V) are the largest tensors of a training step (N = B*T
tokens; 2048 x 50304 fp32 = 412 MB at Pythia-70m, batch 4 x 512), and the plain path
``F.cross_entropy(lm_head(h))`` writes several of them: the logits, the log-probabilities,
their gradient and the gradient of the logits. ``LMHead`` computes the same loss and the same
gradients with ONE (N, V) buffer:

* forward: logits = h @ W^T into the buffer; the loss from a row-blocked ``log_softmax``
  whose blocks stay in cache (only the picked log-probability and the row's log-sum-exp
  are kept);
* backward: the buffer is overwritten in place, block by block, with the logits' gradient
  ``(softmax - onehot) * scale`` (the logits are not needed any more), then
  grad_h = G @ W and grad_W = G^T @ h.

On the CPU the buffer is also kept between steps (``LMHead._workspace``): a fresh 400 MB
allocation is a fresh ``mmap`` whose first touch page-faults every page, which costs as much
as a pass over the tensor. Elsewhere a new buffer is taken each step: CUDA's caching
allocator already reuses the block, and a kept one would pin N x V memory through the
optimizer step, evaluation and checkpointing.

Under autocast the head runs in the autocast dtype, as ``F.linear`` would (the custom op
itself is not autocast-aware). Targets must be in [0, V) or -100; other negatives are not
checked (a check is a host sync per step) and count as class 0.

The price is that the logits are not returned when a loss that will be differentiated is
computed (``forward`` gives ``logits=None``), as Liger-style fused heads do; without targets,
or under ``torch.no_grad()``, the head is a plain Linear and the logits are returned.

On a GPU with Liger Kernel installed (``pip install liger-kernel``, an optional dependency) the
differentiated loss is Liger's fused linear cross-entropy instead (``liger_loss``): Triton kernels
over chunks of rows, which never hold the (N, V) logits, with the weight gradient accumulated in
fp32 (``accum_dtype``) as ours is. Same loss and gradients to bf16 rounding (bench/gpu_check.py's
``fused_ce`` section checks and times both); the CPU, and a GPU without it, keep ours.
``USE_LIGER = False`` turns it off. The count of top-1 hits (``top1``) reads the logits: ours.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

USE_LIGER = True  # a differentiated loss on a GPU uses Liger Kernel's fused linear cross-entropy when installed
CPU_BLOCK = 32  # rows: 32 x 50304 fp32 = 6.4 MB stays in cache between a block's passes
ACCEL_BLOCK_BYTES = 256 * 2**20  # fp32 scratch per block elsewhere


def block_rows(logits: torch.Tensor) -> int:
    """Rows per block of the loss loops over logits (N, V).

    On the CPU small blocks keep the two passes over a block in cache. On a GPU every block is
    a few kernel launches, and N/32 of them would cost as much as the step (16k tokens ->
    5k launches): there blocks only bound the fp32 scratch (256 MiB, 1334 rows at V=50304)."""
    if logits.device.type == "cpu":
        return CPU_BLOCK
    return max(CPU_BLOCK, ACCEL_BLOCK_BYTES // (4 * logits.shape[-1]))


def top1_hits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rows (..., V) whose target (-100: not counted) has the largest logit (ties count), as a
    count; row-blocked like the loss, so the (N, V) logits are read once more, not recomputed."""
    logits, targets = logits.flatten(0, -2), targets.flatten()
    hits = torch.zeros((), device=logits.device, dtype=torch.long)
    R = block_rows(logits)
    for s in range(0, logits.shape[0], R):
        blk, t = logits[s : s + R], targets[s : s + R]
        x_t = blk.gather(1, t.clamp_min(0)[:, None])[:, 0]
        hits += ((x_t >= blk.amax(-1)) & (t != -100)).sum()
    return hits


def _picked_and_lse(logits: torch.Tensor, safe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-blocked log-softmax of logits (N, V) at the columns ``safe`` (N, 1).

    Returns (picked log-probabilities (N,), log-sum-exp per row (N,)), fp32. The log-sum-exp
    is recovered as ``x_t - logp_t`` from the same block (no second reduction pass)."""
    N, R = logits.shape[0], block_rows(logits)
    picked = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(picked)
    for s in range(0, N, R):
        blk = logits[s : s + R].float()
        x_t = blk.gather(1, safe[s : s + R])[:, 0]
        picked[s : s + R] = torch.log_softmax(blk, dim=-1).gather(1, safe[s : s + R])[:, 0]
        lse[s : s + R] = x_t - picked[s : s + R]
    return picked, lse


def _mean_nll(picked: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    count = valid.sum()
    return -(picked * valid).sum() / count, count  # NaN when every target is ignored, as F.cross_entropy


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored (-100) targets; logits (..., V), targets (...).

    The value of ``F.cross_entropy(logits.float(), targets)`` without its (N, V) fp32
    log-probabilities; for evaluation (it has no backward of its own: training goes through
    ``LMHead``)."""
    with torch.no_grad():
        targets = targets.flatten()
        picked, _ = _picked_and_lse(logits.flatten(0, -2), targets.clamp_min(0)[:, None])
        return _mean_nll(picked, targets != -100)[0]


@functools.cache
def liger_loss() -> Callable | None:
    """Liger Kernel's ``liger_fused_linear_cross_entropy(input (N, d), weight (V, d), target (N,),
    ...)``, or None where it is not installed or does not import (no Triton, a version without it)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # an optional speed-up: a broken install must not stop training
        return None
    return liger_fused_linear_cross_entropy


def external_loss(h: torch.Tensor) -> Callable | None:
    """The library loss the head uses for ``h`` (a GPU tensor, ``USE_LIGER``, Liger installed), or None: ours."""
    return liger_loss() if USE_LIGER and h.is_cuda else None


class _HeadLoss(torch.autograd.Function):
    """loss = mean CE(h @ W^T, targets) over non-ignored targets; h (N, d), W (V, d)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, head: "LMHead") -> torch.Tensor:
        buf, ctx.lease = head._take_buffer((h.shape[0], weight.shape[0]), h)
        torch.mm(h, weight.t(), out=buf)  # (N, V) logits
        valid = targets != -100  # (N,)
        safe = targets.clamp_min(0)[:, None]  # (N, 1); ignored rows masked by ``valid``
        picked, lse = _picked_and_lse(buf, safe)
        loss, count = _mean_nll(picked, valid)
        if head._count_top1:  # asked by the caller (multi-token prediction): before the backward reuses buf
            head._top1 = top1_hits(buf, targets)
        ctx.save_for_backward(h, weight, buf, safe, valid, count, lse)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, buf, safe, valid, count, lse = ctx.saved_tensors
        # (N, 1) fp32; exactly 0 on ignored rows, even when all are (count 0) or grad_loss is not finite
        scale = torch.where(valid, grad_loss / count.clamp_min(1), 0.0)[:, None]
        R = block_rows(buf)
        for s in range(0, buf.shape[0], R):  # buf := (softmax(buf) - onehot) * scale, in place
            blk, sc, t = buf[s : s + R], scale[s : s + R], safe[s : s + R]
            if blk.dtype == torch.float32:  # softmax in one fused pass, scaled into the buffer
                torch.mul(torch.softmax(blk, dim=-1), sc, out=blk)
                blk.scatter_add_(1, t, -sc)
            else:  # low precision: exp(x - lse) in an fp32 copy, onehot subtracted, rounded once
                g = blk.float().sub_(lse[s : s + R, None]).exp_().mul_(sc)
                blk.copy_(g.scatter_add_(1, t, -sc))
        gh = torch.mm(buf, weight) if ctx.needs_input_grad[0] else None  # (N, d)
        gw = torch.mm(buf.t(), h) if ctx.needs_input_grad[1] else None  # (V, d)
        ctx.lease.done = True  # the next forward may take the workspace
        return gh, gw, None, None


class _Lease:
    """Who holds the CPU workspace: the graph of one forward, until its backward has run
    (``done``) or the graph is freed without one (the lease is garbage then)."""

    done = False


class LMHead(nn.Linear):
    """``nn.Linear(d, V, bias=False)`` (state-dict key ``lm_head.weight`` as before) whose
    ``forward(h, targets)`` also gives the fused next-token loss; see the module docstring.

    ``forward(h)`` -> logits (..., V). ``forward(h, targets)`` -> (logits or None, loss):
    logits None when the loss will be differentiated (grad enabled and h or W needs grad).
    Its backward overwrites the buffer it saved, so differentiating the same loss twice
    (``retain_graph=True``) is refused by autograd's in-place check instead of going wrong.
    """

    def __init__(self, d: int, vocab: int):
        super().__init__(d, vocab, bias=False)
        self._workspace: torch.Tensor | None = None  # CPU scratch, not state (not saved or moved)
        self._holder: weakref.ref | None = None  # the _Lease of the forward holding the workspace
        self._count_top1, self._top1 = False, None  # forward(..., top1=True): hits handed back

    def __getstate__(self):  # pickle / deepcopy: the workspace is scratch, not state
        return {**super().__getstate__(), "_workspace": None, "_holder": None, "_top1": None}

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, top1: bool = False):
        """``top1``: also return the count of rows whose target has the largest logit (read from
        the logits the loss already computed): (logits or None, loss, hits)."""
        if targets is None:
            return F.linear(h, self.weight)
        if top1:
            self._count_top1 = True
            try:
                logits, loss = self.forward(h, targets)
            finally:
                self._count_top1 = False
            hits = top1_hits(logits, targets) if logits is not None else self._top1
            self._top1 = None
            return logits, loss, hits
        if not (torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad)):
            logits = F.linear(h, self.weight)
            return logits, cross_entropy(logits, targets)
        w, dev, amp = self.weight, h.device.type, contextlib.nullcontext()
        if torch.is_autocast_enabled(dev):  # what F.linear would do: both operands in the autocast dtype
            dt = torch.get_autocast_dtype(dev)
            h, w = h.to(dt), w.to(dt)  # differentiable casts: an fp32 weight gets an fp32 gradient
            amp = torch.autocast(dev, enabled=False)  # the op's own mm(out=) is not autocast-aware
        with amp:
            fused = None if self._count_top1 else external_loss(h)  # top1 reads logits that Liger never makes
            if fused is not None:  # mean over the non-ignored targets, as ours; weight gradient summed in fp32
                return None, fused(h.flatten(0, -2), w, targets.flatten(), ignore_index=-100, accum_dtype=torch.float32)
            return None, _HeadLoss.apply(h.flatten(0, -2), w, targets.flatten(), self)

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): drop the scratch with the old layout
        self._workspace, self._holder = None, None
        return super()._apply(fn, recurse)

    def _take_buffer(self, shape: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, _Lease]:
        """The (N, V) buffer of one forward and its lease: on the CPU the kept workspace,
        unless another forward's graph still holds it (two forwards before a backward)."""
        lease, n = _Lease(), shape[0] * shape[1]
        held = self._holder() if self._holder is not None else None
        if like.device.type != "cpu" or (held is not None and not held.done):
            return torch.empty(shape, device=like.device, dtype=like.dtype), lease
        ws = self._workspace
        if ws is None or ws.dtype != like.dtype or ws.numel() < n:
            self._workspace = None  # free the old one first: peak memory of one workspace
            ws = self._workspace = torch.empty(n, dtype=like.dtype)
        self._holder = weakref.ref(lease)
        return ws[:n].view(shape), lease
