"""Interventions: edits of a forward that the full forward, the prefill and every decoding
step honour identically (so an intervened cached decode equals the intervened full forward).

Three kinds, each applying to a range of positions (``start``, at most ``length`` of them) and
optionally to some batch ``rows`` only:

* ``CodeEdit``: the concept signal, per concept and code. The code weights w (B, M, S, N) of
  the concepts with index j in range become ``w * scale + shift`` (``scale``/``shift`` (S, N)
  or per row (B, S, N)) *after* their normalisation, so ``scale`` 0 at (s, n) removes exactly
  that code's term from pred = sum_n w[s, n] * code[s, n] (ablation). Positions are concept
  indices j.
* ``AddToDecoderInput``: z[t] += vector at token positions t in range (steering at the decoder
  input; ``vector`` (d,) or per row (B, d)).
* ``AddToResidual``: the same, added to the residual stream after layer ``layer`` (0-based)
  of the ``encoder`` or ``decoder`` stack; with ``onward``, after that layer and after every later
  layer of the stack (Steerling's injection at every layer from ``inject_layer`` on: its
  ``inject_layer`` k is ``layer`` k - 1 here).
* ``AddToReadout``: the same, added to what the LM head reads (after the final norm and the
  concept bottleneck: h_bar). On a bottleneck model adding gamma * K_c there is exactly raising
  known concept c's activation by gamma / ||K_c|| (Steerling's concept intervention).

Positions are those of the tokens (0 = a row's first real token), whatever the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Intervention:
    start: int = 0  # first position it applies to
    length: int | None = None  # at most this many positions (None: to the end)
    rows: Sequence[int] | None = None  # batch rows it applies to (None: all)
    # (B, T) bool: the token slots of a full forward it applies to, besides start/length/rows (a
    # training injection at labelled positions); None: every slot. A full forward only: it is
    # refused in a prefill or decoding step, whose slots are not the forward's
    where: torch.Tensor | None = None

    def mask(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """(B, T) bool: where it applies, for integer positions (B|1, T)."""
        m = positions >= self.start
        if self.length is not None:
            m = m & (positions < self.start + self.length)
        m = m.expand(batch, positions.shape[-1])
        if self.where is not None:
            if self.where.shape != m.shape:
                raise ValueError(f"{type(self).__name__}.where is {tuple(self.where.shape)}, the forward's slots "
                                 f"{tuple(m.shape)} (where is for a full forward only)")
            m = m & self.where
        if self.rows is not None:
            keep = torch.zeros(batch, dtype=torch.bool, device=positions.device)
            keep[list(self.rows)] = True
            m = m & keep[:, None]
        return m


def _per_row(v: torch.Tensor, batch: int, row_dims: int) -> torch.Tensor:
    """v shaped (*item) or (B, *item) -> (B, 1, *item) for broadcasting over positions."""
    v = v if v.dim() > row_dims else v.expand(batch, *v.shape)
    return v[:, None]


@dataclass
class CodeEdit(Intervention):
    scale: torch.Tensor | None = None  # (S, N) or (B, S, N)
    shift: torch.Tensor | None = None  # (S, N) or (B, S, N)

    def apply(self, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """w (B, M, S, N) of concepts with indices ``index`` (B|1, M)."""
        B = w.shape[0]
        m = self.mask(index, B)[..., None, None]  # (B, M, 1, 1)
        new = w
        if self.scale is not None:
            new = new * _per_row(self.scale.to(w), B, 2)
        if self.shift is not None:
            new = new + _per_row(self.shift.to(w), B, 2)
        return torch.where(m, new, w)


@dataclass
class AddToDecoderInput(Intervention):
    vector: torch.Tensor | None = None  # (d,) or (B, d)

    def addition(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(B, T, d) to add to like (B, T, d) at token positions (B|1, T)."""
        B = like.shape[0]
        return self.mask(positions, B)[..., None].to(like.dtype) * _per_row(self.vector.to(like), B, 1)


@dataclass
class AddToResidual(AddToDecoderInput):
    stack: str = "decoder"  # "encoder" | "decoder"
    layer: int = 0  # after this layer (0-based in its stack)
    onward: bool = False  # and after every later layer of the stack too


@dataclass
class AddToReadout(AddToDecoderInput):
    pass


def check(interventions: Sequence[Intervention] | None, n_layers: dict[str, int]) -> list[Intervention]:
    """The interventions as a list, with their targets checked (ValueError naming the problem)."""
    out = list(interventions or ())
    for iv in out:
        if not isinstance(iv, Intervention):
            raise ValueError(f"not an intervention: {iv!r}")
        if isinstance(iv, AddToResidual):
            n = n_layers.get(iv.stack)
            if n is None or not -n <= iv.layer < n:
                raise ValueError(f"AddToResidual: no layer {iv.layer} in stack {iv.stack!r} ({n or 0} layers)")
        elif isinstance(iv, AddToDecoderInput) and iv.vector is None:
            raise ValueError(f"{type(iv).__name__}: vector is required")
    return out


def edit_code_weights(ivs: Sequence[Intervention], w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    for iv in ivs:
        if isinstance(iv, CodeEdit):
            w = iv.apply(w, index)
    return w


def decoder_input_addition(ivs: Sequence[Intervention], z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    for iv in ivs:
        if type(iv) is AddToDecoderInput:
            z = z + iv.addition(positions, z)
    return z


def readout_vector(ivs: Sequence[Intervention], h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The sum (B, T, d) of the readout additions to h (B, T, d); None without any."""
    out = None
    for iv in ivs:
        if type(iv) is AddToReadout:
            add = iv.addition(positions, h)
            out = add if out is None else out + add
    return out


def readout_addition(ivs: Sequence[Intervention], h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    add = readout_vector(ivs, h, positions)
    return h if add is None else h + add


def residual_additions(ivs: Sequence[Intervention], stack: str, n_layers: int, positions: torch.Tensor,
                       like: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer: (B, T, d)} to add after each layer of ``stack`` for token positions (B|1, T)."""
    out: dict[int, torch.Tensor] = {}
    for iv in ivs:
        if isinstance(iv, AddToResidual) and iv.stack == stack:
            add = iv.addition(positions, like)
            first = iv.layer % n_layers
            for layer in range(first, n_layers if iv.onward else first + 1):
                out[layer] = out[layer] + add if layer in out else add
    return out
