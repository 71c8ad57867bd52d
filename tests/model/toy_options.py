"""A toy design that declares its own recipe keys, built only through the public API (no file
under ncpctl/ knows it): ``ScaledResidual``, the depth mixer x + scale * f(x), whose ``scale``
is the recipe key ``model.options.NAME.scale`` (NAME: the name it is registered under, or its
import path ``tests.model.toy_options:ScaledResidual`` when a recipe names it so)."""

from __future__ import annotations

from dataclasses import dataclass

from ncpctl.model import Residual, option


@dataclass
class ScaledOptions:
    scale: float = option(1.0, "The update's weight: x + scale * f(x) (1: the plain residual).")

    def check(self, cfg) -> list[tuple[str, str]]:
        return [] if self.scale > 0 else [("scale", f"must be > 0, got {self.scale!r}")]


class ScaledResidual(Residual):
    options = ScaledOptions

    def __init__(self, cfg, n_layers: int):
        super().__init__(cfg, n_layers)
        self.scale = cfg.design_options("residual").scale

    def forward(self, layer, x, update, state):
        return x + self.scale * update
