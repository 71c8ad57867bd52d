"""lm-eval scoring through the model's objective (``Objective.score``): the two-ahead toy
(tests/model/toy_objectives.py) scores continuation token k at position k - 2, in batches with
other requests, equal to one full forward per request read by that rule; the default objective's
positions are next-token's (k - 1)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from ncpctl.evaluate.lm import NCPLM

from ..model import toy_objectives  # noqa: F401  (registers the toy objectives)
from ..model._helpers import build, tiny


class _Tok:
    def token_to_id(self, token: str) -> int:
        return 0


def _lm(cfg) -> NCPLM:
    loaded = SimpleNamespace(model=build(cfg, scale=0.3), config=cfg, tokenizer=_Tok(), meta={}, path=Path("toy"))
    return NCPLM(loaded=loaded, batch_size=3)


def _by_rule(model, ctx: list[int], cont: list[int], back: int) -> float:
    seq = ctx + cont
    with torch.no_grad():
        logp = model(torch.tensor(seq)[None]).logits[0, :, : model.cfg.vocab_size].float().log_softmax(-1)
    return sum(float(logp[max(k - back, 0), seq[k]]) for k in range(len(ctx), len(seq)))


def test_scores_follow_the_objective():
    requests = [([5, 9, 3, 7], [11, 12]), ([5, 9, 3, 7], [13]), ([1, 2], [3, 4, 5]), ([8], [9])]
    for objective, back in (("next_token", 1), ("two_ahead", 2)):
        lm = _lm(tiny("neox", objective=objective))
        got = lm._loglikelihood_tokens([(None, c, x) for c, x in requests])
        for (ctx, cont), (ll, _) in zip(requests, got):
            assert abs(ll - _by_rule(lm.model, ctx, cont, back)) < 1e-4, (objective, ctx, cont)
