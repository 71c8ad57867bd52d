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


def test_a_cdlm_answers_with_its_elbo_on_the_continuation_after_a_clean_context():
    """Issue 23 item 4: a Causal Diffusion LM's log-likelihood of a continuation is minus the
    mean of --diffusion-samples estimates of its ELBO, the continuation scored (noised) and the
    context clean (LLaDA-style), the same estimate as ``diffusion_elbo.estimates`` with its noise
    key; Monte Carlo variance accounted per task; is_greedy the one-shot argmax check."""
    from ncpctl.model.designs.causal_diffusion.module import estimates, one_shot_greedy

    cfg = tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=4, mask_id=1))
    lm = _lm(cfg)
    lm.diffusion_samples, lm.diffusion_seed = 5, 7
    requests = [([5, 9, 3, 7, 2], [11, 12, 40]), ([8], [9]), ([5, 9, 3, 7, 2], [11, 12, 40])]
    got = lm._loglikelihood_tokens([(None, c, x) for c, x in requests])
    assert got[0] == got[2] and lm.likelihood == {"kind": "bound", "estimator": lm.likelihood["estimator"],
                                                  "samples": 5, "seed": 7}
    for (ctx, cont), (ll, greedy), var in zip(requests, got, lm._mc_var):
        x = torch.tensor([ctx + cont])
        scored = torch.zeros_like(x, dtype=torch.bool)
        scored[:, len(ctx):] = True
        est = estimates(lm.model, x, scored, samples=5, seed=7)
        assert abs(ll + float(est.mean())) < 1e-9 and ll < 0
        assert abs(var - float(est.var()) / 5) < 1e-9
        assert greedy == bool(one_shot_greedy(lm.model, x, scored)[0])
    # a context edited inside the continuation's block changes the estimate (it is read, clean)
    other = lm._loglikelihood_tokens([(None, [5, 9, 3, 7, 3], [11, 12, 40])])
    assert other[0][0] != got[0][0]


def test_noised_context_beside_the_bound_per_task():
    """Issue 43 item 8: ``noised_context`` (``ncpctl eval --noised-context``) also sums, per task, the
    CDLM's noised-context estimate of each request (``diffusion_elbo.noised_estimates``: every block
    noised, training's conditions) with its Monte Carlo variance; the perplexity summary reports it
    per set beside the bound. Refused for an objective without one."""
    import pytest

    from ncpctl.errors import UserError
    from ncpctl.evaluate.run import perplexity_summary
    from ncpctl.model.designs.causal_diffusion.module import noised_estimates

    cfg = tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=4, mask_id=1))
    loaded = SimpleNamespace(model=build(cfg, scale=0.3), config=cfg, tokenizer=_Tok(), meta={}, path=Path("toy"))
    lm = NCPLM(loaded=loaded, batch_size=3, diffusion_samples=3, noised_context="true")
    assert "noised_context" in lm.likelihood
    reqs = [SimpleNamespace(args=None, task_name="set"), SimpleNamespace(args=None, task_name="set")]
    data = [([5, 9, 3, 7, 2], [11, 12, 40]), ([8, 4, 4], [9, 6, 6, 6, 7])]
    got = lm._loglikelihood_tokens([(None, c, x) for c, x in data])
    answers = []
    for (ll, _), (ctx, cont), v, nz in zip(got, data, lm._mc_var, lm._noised):
        x = torch.tensor([ctx + cont])
        scored = torch.zeros_like(x, dtype=torch.bool)
        scored[:, len(ctx):] = True
        est = noised_estimates(lm.model, x, scored, samples=3, seed=0)
        assert abs(nz[0] - float(est.mean())) < 1e-9 and abs(nz[1] - float(est.var()) / 3) < 1e-9
        answers.append((ll, len(cont), v, *nz))  # as the cached answers carry it
    lm._account(reqs, answers)
    assert lm.cache_settings["noised_context"] is True  # a cached answer without it is not reused
    st = lm.token_stats["set"]
    results = {"set": {"token_perplexity,none": 1.0}}
    (s,) = perplexity_summary(results, lm.token_stats)["per_set"].values()
    assert s["noised_nll_per_token"] == pytest.approx(st["nll_noised"] / 8) and s["noised_nll_stderr"] > 0
    plain = SimpleNamespace(model=build(tiny("llama"), scale=0.3), config=tiny("llama"), tokenizer=_Tok(), meta={},
                            path=Path("ar"))
    with pytest.raises(UserError, match="applies to a Causal Diffusion LM"):
        NCPLM(loaded=plain, noised_context=True)
