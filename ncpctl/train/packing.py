"""One step's logged quantities as one vector, by name, so that one all-reduce per step
reduces them all (style rule 15: named records, not positions).

The layout comes from the model (``log_keys()``, ``stat_keys()``, fixed when it is built)
plus the loop's own flags, so every rank packs the same vector::

    [ log key 1 (size elements) | log key 2 | ... | stat 1 | stat 2 | ... | flag 1 | ... ]

* log keys (``NCPOutput.loss`` for ``loss``, else ``losses`` or ``metrics``): averaged over
  micro-batches and ranks; a key of ``size`` S packs its S elements (``(S,)`` per segment);
  logged as their mean, and with ``per`` also element by element;
* statistics (``NCPOutput.stats``): local sums, summed over micro-batches and ranks;
* flags (the loop's, e.g. ``skipped``, ``stop``): summed over ranks (> 0: some rank set it).

The vector is fp32 on the model's device (no host sync until the collective): statistics are
exact integers up to 2**24 per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ncpctl.model.core.outputs import LogKey

LOSS = "loss"  # the weighted total: the one key the loop itself reads (non-finite check, train_loss)


@dataclass
class Unpacked:
    """A reduced step vector by name: ``terms`` (name -> (size,) float64), ``stats`` and
    ``flags`` (name -> float)."""

    terms: dict[str, torch.Tensor]
    stats: dict[str, float]
    flags: dict[str, float]


class StepPacking:
    """The named layout of the step vector (see the module docstring)."""

    def __init__(self, keys: Sequence[LogKey], stats: Sequence[str] = (), flags: Sequence[str] = (),
                 reserved: Sequence[str] = ()):
        self.keys, self.stats, self.flags = tuple(keys), tuple(stats), tuple(flags)
        names = [k.name for k in self.keys] + [f"{k.name}_per_{k.per}" for k in self.keys if k.per]
        names += [*self.stats, *self.flags, *reserved]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:  # a model bug: two quantities would be logged under one name
            raise ValueError(f"log, statistic and flag names must be unique; repeated: {', '.join(repeated)}")
        if LOSS not in (k.name for k in self.keys):
            raise ValueError(f"the model's log keys must include {LOSS!r}")
        self._slices: dict[str, slice] = {}
        pos = 0
        for k in self.keys:
            self._slices[k.name] = slice(pos, pos + k.size)
            pos += k.size
        self.n_terms = pos
        self.size = pos + len(self.stats) + len(self.flags)

    @classmethod
    def for_model(cls, model: Any, flags: Sequence[str] = (), reserved: Sequence[str] = ()) -> "StepPacking":
        return cls(model.log_keys(), model.stat_keys(), flags, reserved)

    # ---- packing (on the device, no host sync) ----

    def terms(self, out: Any, loss: Any = None) -> torch.Tensor:
        """(n_terms,) fp32: every log key of one forward ``out`` in layout order; ``loss``
        stands in for ``out.loss`` (the injected NaN fault); a key ``out`` lacks packs zeros."""
        ref = out.loss if out.loss is not None else out.logits
        parts = []
        for k in self.keys:
            if k.name == LOSS:
                value = out.loss if loss is None else loss
            else:
                value = out.losses.get(k.name, out.metrics.get(k.name))
            if value is None:
                parts.append(ref.new_zeros(k.size, dtype=torch.float32))
                continue
            value = value.detach().float().reshape(-1)
            if value.numel() != k.size:  # the model declared another size than it returns
                raise ValueError(f"{k.name}: log_keys() declares {k.size} elements, the output has {value.numel()}")
            parts.append(value)
        return torch.cat(parts)

    def stat_sums(self, out: Any) -> torch.Tensor:
        """(n_stats,) fp32: the local sums of ``out.stats`` in layout order (zero where absent)."""
        ref = out.loss if out.loss is not None else out.logits
        vals = [out.stats[n].detach().float().reshape(()) if n in out.stats else ref.new_zeros((), dtype=torch.float32)
                for n in self.stats]
        return torch.stack(vals) if vals else ref.new_zeros(0, dtype=torch.float32)

    def join(self, terms: torch.Tensor, stats: torch.Tensor, flags: Mapping[str, float]) -> torch.Tensor:
        """The whole step vector (size,): terms, statistics, then the flags by name."""
        f = torch.tensor([float(flags[n]) for n in self.flags], dtype=torch.float32, device=terms.device)
        return torch.cat([terms, stats.to(terms.device), f])

    # ---- unpacking (after the collective) ----

    def split_terms(self, terms: torch.Tensor, mean_over: float = 1) -> dict[str, torch.Tensor]:
        """A summed terms vector (n_terms,) -> name -> (size,) values divided by ``mean_over``."""
        return {k.name: terms[self._slices[k.name]] / mean_over for k in self.keys}

    def split(self, vec: torch.Tensor, mean_over: float = 1) -> Unpacked:
        """A reduced step vector by name; the terms divided by ``mean_over`` (the ranks summed)."""
        n, s = self.n_terms, len(self.stats)
        return Unpacked(self.split_terms(vec[:n], mean_over),
                        {name: float(v) for name, v in zip(self.stats, vec[n:n + s])},
                        {name: float(v) for name, v in zip(self.flags, vec[n + s:])})

    def record(self, terms: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Train-record fields: each key's mean under its name, and for keys with ``per`` its
        elements as ``{name}_per_{per}`` (rounded to 6 digits), in layout order."""
        rec: dict[str, Any] = {}
        for k in self.keys:
            rec[k.name] = float(terms[k.name].mean())
            if k.per:
                rec[f"{k.name}_per_{k.per}"] = [round(float(u), 6) for u in terms[k.name]]
        return rec

    def scalars(self, terms: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Validation-record fields: the mean of every key without per-element logging (the
        per-element ones, such as codebook usage per segment, are training diagnostics) and not
        ``train_only`` (terms the model computes in training only, such as the MTP loss)."""
        return {k.name: float(terms[k.name].mean()) for k in self.keys if not k.per and not k.train_only}
