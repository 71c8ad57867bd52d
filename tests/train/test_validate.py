"""``ncpctl.train.validate``: with ``data.mix`` the plain validation keys are the components' mean
under their normalised weights (issue 42 item 6: weights of 5e-324 each, which the recipe accepts,
gave a loss of 8.0 where each component's was 8.465: the raw weights' products are subnormal and
keep a few bits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("weights", [(5e-324, 5e-324), (1e308, 1e308, 1e308), (0.25, 0.75)])
def test_the_mixture_mean_uses_normalised_weights(monkeypatch, weights) -> None:
    from ncpctl.train import validate as v

    losses = [8.465, 8.465, 8.465][: len(weights)]
    per = {f"c{i}": {"loss": loss + i * 0.5} for i, loss in enumerate(losses)}
    monkeypatch.setattr(v, "_split", lambda run, val, batches: per[val])
    engine = SimpleNamespace(eval=lambda: None, train=lambda: None, module=None)
    hooks = SimpleNamespace(eval_begin=lambda module, final: None, eval_end=lambda d: {})
    data = SimpleNamespace(val_loaders=lambda r, rank, world: [(name, w, name, 1) for name, w in zip(per, weights)])
    run = SimpleNamespace(recipe=None, d=SimpleNamespace(rank=0, world=1), engine=engine, hooks=hooks, data=data)
    out = v.validate(run)
    total = sum(w / max(weights) for w in weights)
    want = sum(w / max(weights) / total * per[n]["loss"] for n, w in zip(per, weights))
    assert out["loss"] == pytest.approx(want, rel=1e-12)
    assert all(out[f"loss/{n}"] == per[n]["loss"] for n in per)


def test_normalised_weights_survive_subnormal_and_overflowing_sums() -> None:
    from ncpctl.data.mix import normalised

    assert normalised([5e-324, 5e-324]) == [0.5, 0.5]
    assert normalised([1e308, 1e308]) == [0.5, 0.5]  # a sum that overflows
    assert normalised([0.3, 0.7]) == [0.3 / 1.0, 0.7 / 1.0]  # ordinary weights: divided by their sum, as before
