"""``GuardedAdamW``: torch AdamW that skips a step whose gradient is not finite (the stage-0 fp32
path, where DeepSpeed does not), the base of ``ncpctl.train.muon.MuonAdamW``; ``ncpctl.train.optimizer``
builds either. Below both, so that neither imports the other."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that (optionally) clips and skips non-finite steps, the way DeepSpeed's ZeRO
    optimizers do: ``overflow`` tells the engine the step was skipped (it then counts it and
    does not advance the lr schedule), ``_global_grad_norm`` is the pre-clip norm it reports.

    With ``guard=False`` (ZeRO stages: their wrapper guards, clips and measures) this is plain AdamW.
    """

    def __init__(self, params: Iterable[Any], *, guard: bool, max_norm: float, **kw: Any):
        super().__init__(params, **kw)
        self.guard, self.max_norm = guard, max_norm
        self.overflow = False
        self._global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self.guard:
            return self._update(closure)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        self._global_grad_norm = float(norm)  # before clipping, like DeepSpeed reports it
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:  # leave the weights and the moments untouched; the engine counts it
            return None
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        return self._update(closure)

    def _update(self, closure: Callable[[], Any] | None) -> Any:
        """The update proper (AdamW here; ``MuonAdamW`` adds its Muon groups)."""
        return super().step(closure)
