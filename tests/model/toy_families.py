"""A toy backbone family built only through ncpctl's public extension point (``ncpctl.model``:
``Family``, ``register``): no file under ncpctl/ knows it.

``relu2``: ScaleNorm (one learned gain g: g * sqrt(d) * x / ||x||, Nguyen & Salazar 2019) in place
of LayerNorm/RMSNorm, a squared-ReLU MLP (So et al. 2021, Primer) at 3 d, rotary on half of each
head, no biases, sequential blocks whose update a learned gain scales (a ``Block`` subclass: a
layout of its own); its own check refuses a parallel residual. It has no Hugging
Face model (the ``Family`` defaults refuse the conversion by name).

Importable by path (``tests.model.toy_families:ReLU2``) for recipes run by the real CLI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model import Block, Family, register


class ScaleNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1))  # not 0-dim: DeepSpeed broadcasts parameters as bytes
        self.scale, self.eps = dim ** 0.5, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * self.scale * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)


class ReLU2MLP(nn.Module):
    """d -> ffn -> d with relu(x)^2; the output projection is ``proj`` (the family contract)."""

    def __init__(self, d: int, ffn: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d, ffn, bias=bias)
        self.proj = nn.Linear(ffn, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class GainBlock(Block):
    """The standard block with its update R scaled by a learned gain (1 at init)."""

    def __init__(self, cfg, window=None, cross=None):
        super().__init__(cfg, window, cross)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x, ctx, cache=None):
        return self.gain * super().forward(x, ctx, cache)


@register("backbone", "relu2")
class ReLU2(Family):
    def defaults(self, cfg):
        return dict(ffn_dim=3 * cfg.d_model, rotary_pct=0.5, parallel_residual=False, bias=False)

    def check(self, cfg):
        return [("parallel_residual", "relu2 blocks are sequential")] if cfg.parallel_residual else []

    def norm(self, cfg, dim):
        return ScaleNorm(dim, cfg.norm_eps)

    def mlp(self, cfg):
        return ReLU2MLP(cfg.d_model, cfg.ffn_dim, cfg.bias)

    def block(self, cfg, window, cross=None):
        return GainBlock(cfg, window, cross)
