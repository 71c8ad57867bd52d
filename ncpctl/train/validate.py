"""Validation passes of a training run (``ncpctl.train.loop._evaluate``): the model's log keys
averaged over micro-batches, batches and ranks (one collective per split), the objective's
held-out records, and the designs' own keys (their evaluation hooks, ``ncpctl.train.hooks``).

With ``data.mix`` each component that has a validation split is evaluated on its own: its keys
are logged as ``KEY/NAME`` (``loss/nemotron_cc``), and the plain keys are the components'
weighted mean (what one blended validation set gives in expectation), weights normalised.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ncpctl.data.mix import normalised


def validate(run: Any, final: bool = False) -> dict[str, float]:
    """The validation record of ``run`` (``ncpctl.train.prepare.Run``); ``final``: the run's last evaluation."""
    r, d, engine, hooks = run.recipe, run.d, run.engine, run.hooks
    engine.eval()
    hooks.eval_begin(engine.module, final)
    per = [(name, w, _split(run, val, batches))
           for name, w, val, batches in run.data.val_loaders(r, d.rank, d.world)]
    if len(per) == 1 and per[0][0] is None:
        out = per[0][2]
    else:
        # normalised first: raw weights of 5e-324 each are subnormal, and w * loss rounds to a few bits
        weights = normalised([w for _, w, _ in per])
        keys = [k for k in per[0][2] if all(isinstance(s.get(k), (int, float)) for _, _, s in per)]
        out = {k: sum(w * s[k] for w, (_, _, s) in zip(weights, per)) for k in keys}
        out.update({f"{k}/{name}": v for name, _, s in per for k, v in s.items()})
    out.update(hooks.eval_end(d))
    engine.train()
    return out


def _split(run: Any, val: Any, batches: int) -> dict[str, float]:
    """One validation split: ``batches`` batches of ``val`` (a fresh loader: the same fixed
    batches at every evaluation), reduced over ranks."""
    r, d, engine, pk, hooks = run.recipe, run.d, run.engine, run.packing, run.hooks
    micro = r.train.micro_batch_size
    objective = engine.module.objective
    acc = torch.zeros(pk.n_terms, device=d.device)
    held: dict[str, torch.Tensor] = {}  # the objective's held-out sums (Objective.validation: the CDLM's ELBO)
    with torch.no_grad():
        for _ in range(batches):
            windows = torch.from_numpy(next(val))
            ids = torch.from_numpy(val.sample_ids()).split(micro)  # the same at every evaluation
            extra = hooks.inputs(val, math.ceil(windows.shape[0] / micro), micro, d.device, evaluating=True)
            for i, (mb, mb_ids, kw) in enumerate(zip(windows.split(micro), ids, extra)):  # (micro, T+1)
                x, y = (t.to(d.device) for t in objective.keyed_batch(mb, mb_ids))
                o = engine(x, y, **kw)
                hooks.eval_micro(i, o)
                acc += pk.terms(o)
                for k, v in objective.validation(engine.module, mb.to(d.device), mb_ids.to(d.device)).items():
                    held[k] = held[k] + v if k in held else v
    terms = pk.split_terms(d.sum(acc), mean_over=d.world * batches * r.grad_accum_steps)
    out = pk.scalars(terms)
    out.update(objective.validation_record({k: d.sum(v) for k, v in held.items()}))
    return out
