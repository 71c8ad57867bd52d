"""Issue 23 item 4: the held-out ELBO of a Causal Diffusion LM (ncpctl/model/designs/causal_diffusion/module.py).

The Monte Carlo estimator equals the bound computed exactly by enumeration (every mask of every
block, t integrated out: a mask of k of a block's n scored positions has the 1/t-weighted
probability  integral of t^(k-1) (1-t)^(n-k) dt = B(k, n-k+1)), within 3 standard errors over
several seeds, for whole sequences and for a continuation scored after a clean context that
shares its block; the enumerated bound is the mean over unmasking orders of their NLL and lies
above the NLL of the model's any-order generation (computed by enumerating the orders); each block is scored on the clean earlier blocks (a later block's tokens never
change an earlier block's term); the draws are keyed (the same rows give the same estimate in
any batch)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.designs.causal_diffusion.module import estimates, one_shot_greedy, summarise

from ._helpers import build, tiny

BLOCK, MASK, V, L = 3, 1, 8, 6


@pytest.fixture(scope="module")
def model():
    cfg = tiny("llama", objective="causal_diffusion", vocab_size=V, pad_vocab_multiple=8, n_layers=2,
               diffusion=dict(block_size=BLOCK, mask_id=MASK))
    return build(cfg, scale=0.5).double()


@torch.no_grad()
def exact_bound(model, x: torch.Tensor, scored: torch.Tensor) -> float:
    """The MDLM bound of one row x (L,) over its ``scored`` positions, by enumeration: for each
    block, every non-empty subset M of its n scored positions, weight B(k, n-k+1) (t integrated
    out of P(M | t) / t), the full sequence as input (the later blocks clean: invisible anyway)."""
    total = 0.0
    for lo in range(0, x.numel(), BLOCK):
        pos = [i for i in range(lo, min(lo + BLOCK, x.numel())) if scored[i]]
        n = len(pos)
        for k in range(1, n + 1):
            w = math.gamma(k) * math.gamma(n - k + 1) / math.gamma(n + 1)  # B(k, n-k+1)
            for M in itertools.combinations(pos, k):
                y = x.clone()
                y[list(M)] = MASK
                logp = F.log_softmax(model(y[None]).logits[0, :, :V].double(), -1)
                total += w * float(-logp[list(M), x[list(M)]].sum())
    return total


@pytest.mark.parametrize("scored_from", [0, 4])  # every token; a continuation from position 4 (inside block 1)
def test_estimator_equals_the_enumerated_bound_within_three_standard_errors(model, scored_from):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(2, V, (2, L), generator=g)  # no [MASK] in the data
    scored = torch.zeros(2, L, dtype=torch.bool)
    scored[:, scored_from:] = True
    exact = sum(exact_bound(model, x[r], scored[r]) for r in range(2)) / int(scored.sum())
    for seed in range(4):
        b = summarise(estimates(model, x, scored, samples=300, seed=seed), int(scored.sum()))
        assert b.samples == 300 and b.tokens == int(scored.sum()) and 0 < b.stderr < 0.1 * exact
        assert abs(b.nll - exact) < 3 * b.stderr, (seed, b, exact)


def test_each_block_is_scored_on_the_clean_earlier_blocks(model):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(2, V, (1, L), generator=g)
    first = torch.zeros(1, L, dtype=torch.bool)
    first[:, :BLOCK] = True  # block 0's term only
    y = x.clone()
    y[0, BLOCK + 1] = 2 + (x[0, BLOCK + 1] - 1) % (V - 2)  # another token of block 1
    a, b = (estimates(model, t, first, samples=6, seed=1) for t in (x, y))
    assert torch.equal(a, b)  # a later block never reaches an earlier block's term
    second = ~first
    z = x.clone()
    z[0, 0] = 2 + (x[0, 0] - 1) % (V - 2)  # block 0 is block 1's context: clean, so seen as it is
    a, c = (estimates(model, t, second, samples=6, seed=1) for t in (x, z))
    assert not torch.allclose(a, c)


def test_draws_are_keyed_on_the_row_not_its_place_in_the_batch(model):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(2, V, (3, L), generator=g)
    keys = torch.tensor([10, 11, 12])
    full = estimates(model, x, samples=4, seed=2, keys=keys)
    alone = estimates(model, x[2:], samples=4, seed=2, keys=keys[2:])
    assert torch.allclose(full[2:], alone, rtol=1e-12, atol=1e-12)
    assert not torch.equal(full, estimates(model, x, samples=4, seed=3, keys=keys))  # the seed matters
    b = summarise(estimates(model, x, samples=4, seed=2, keys=keys), x.numel())
    assert b.tokens == 3 * L and abs(b.nll - float(full.sum(0).mean()) / (3 * L)) < 1e-12


def test_one_shot_greedy_reads_the_argmax_of_the_masked_block(model):
    x = torch.tensor([[2, 3, 4, 5, 6, 7]])
    scored = torch.tensor([[False, False, False, False, True, True]])
    y = x.clone()
    y[0, 4:] = MASK
    pred = model(y).logits[0, 4:, :V].argmax(-1)
    want = x.clone()
    want[0, 4:] = pred
    assert bool(one_shot_greedy(model, want, scored)[0])
    other = want.clone()
    other[0, 5] = 2 + (pred[1] - 1) % (V - 2)  # not the argmax
    assert not bool(one_shot_greedy(model, other, scored)[0])


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_eval_samples_is_checked_by_key_and_zero_turns_validation_off(model, bad):
    from ncpctl.model import ConfigError, ModelConfig

    base = dict(backbone="neox", vocab_size=V, pad_vocab_multiple=8, d_model=32, n_layers=2, n_heads=4,
                max_seq_len=64, objective="causal_diffusion")
    with pytest.raises(ConfigError) as e:
        ModelConfig(**base, diffusion=dict(mask_id=MASK, eval_samples=bad))
    assert [k for k, _ in e.value.problems] == ["diffusion.eval_samples"]
    w = torch.randint(2, V, (2, L + 1), generator=torch.Generator().manual_seed(6))
    ob = model.objective
    sums = ob.validation(model, w, torch.tensor([4, 9]))  # eval_samples: 4 (the default)
    assert sums["diffusion_elbo"].shape == (5,) and sums["diffusion_elbo"][-1] == 2 * L
    rec = ob.validation_record(sums)
    assert set(rec) == {"diffusion_elbo", "diffusion_elbo_stderr"} and rec["diffusion_elbo"] > 0
    ob.d.eval_samples = 0
    try:
        assert ob.validation(model, w, torch.tensor([4, 9])) == {} and ob.validation_record({}) == {}
    finally:
        ob.d.eval_samples = 4


@torch.no_grad()
def test_the_bound_is_above_the_models_nll_of_any_order_unmasking(model):
    """The model's likelihood of a block given the clean earlier ones, as its reverse process
    generates (unmask one uniformly chosen position at a time: a mixture over the n! orders), is
    computable by enumeration here; its NLL is below the bound (Jensen: the bound is the mean over
    the orders of the NLL of each, which the enumeration with t integrated out equals), and the
    Monte Carlo estimate agrees."""
    g = torch.Generator().manual_seed(8)
    x = torch.randint(2, V, (L,), generator=g)
    nll = mean_over_orders = 0.0
    for lo in range(0, L, BLOCK):
        pos = list(range(lo, lo + BLOCK))
        logs = []
        for order in itertools.permutations(pos):
            y, lp = x.clone(), 0.0
            y[pos] = MASK
            for i in order:  # reveal i given the revealed ones
                lp += float(F.log_softmax(model(y[None]).logits[0, i, :V].double(), -1)[x[i]])
                y[i] = x[i]
            logs.append(lp)
        nll -= float(torch.logsumexp(torch.tensor(logs), 0)) - math.log(len(logs))
        mean_over_orders -= sum(logs) / len(logs)
    bound = exact_bound(model, x, torch.ones(L, dtype=torch.bool))
    assert abs(bound - mean_over_orders) < 1e-9  # the t-integrated weights are the any-order mean
    assert nll < bound - 1e-3, (nll, bound)
    est = summarise(estimates(model, x[None], samples=200, seed=0), 1)
    assert abs(est.nll - bound) < 3 * est.stderr


@torch.no_grad()
@pytest.mark.parametrize("window", [None, 5])
def test_the_two_copy_forward_gives_the_per_block_estimate_with_the_same_masks(window):
    """Issue 43 item 6: one forward over [noised blocks; clean prefix] per sample (BD3-LM's two-copy
    mask) gives each noised block the states of a forward over its clean prefix and itself, so the
    estimate equals the per-block estimator's with the same keyed masks, in fp32 (a sliding window
    too): whole windows, a continuation that starts inside a block, rows scored in different blocks."""
    cfg = tiny("llama", objective="causal_diffusion", sliding_window=window, diffusion=dict(block_size=4, mask_id=MASK))
    m = build(cfg, scale=0.3)
    x = torch.randint(2, 200, (3, 18), generator=torch.Generator().manual_seed(5))
    scored = torch.zeros_like(x, dtype=torch.bool)
    scored[0] = True
    scored[1, 9:] = True  # a continuation from inside block 2
    scored[2, 5:7] = True  # one block only
    for sc in (None, scored):
        a = estimates(m, x, sc, samples=3, seed=2, keys=torch.tensor([7, 8, 9]), max_rows=4)
        b = estimates(m, x, sc, samples=3, seed=2, keys=torch.tensor([7, 8, 9]), method="per_block")
        assert a.shape == (3, 3) and (a > 0).any(1).all() and (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max())


def test_the_bound_bench_runs_at_its_smallest_size(capsys):
    """bench/cdlm_bound.py (the speed-up in docs/designs/steerling.md) at one short window, in process: the two methods
    agree."""
    import importlib.util
    import json

    from ..conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_cdlm_bound", REPO / "bench" / "cdlm_bound.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--seq-len", "32", "--samples", "2", "--repeats", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["seq_len"] == 32 and row["max_abs_diff_per_token"] < 1e-5 and row["per_block_s"] > 0


@torch.no_grad()
def test_the_noised_context_estimate_conditions_later_blocks_on_noised_ones(model):
    """Issue 43 item 8: every block noised at once with the bound's own keyed masks (training's
    conditions). On the first block (no earlier block) it IS the bound, sample by sample; on later
    blocks it conditions on noised earlier blocks, so it differs from the clean-context bound (here
    by more than 3 standard errors of the paired difference)."""
    from ncpctl.model.designs.causal_diffusion.module import noised_estimates

    x = torch.randint(2, V, (2, L), generator=torch.Generator().manual_seed(9))
    first = torch.zeros_like(x, dtype=torch.bool)
    first[:, :BLOCK] = True
    a, b = noised_estimates(model, x, first, samples=6, seed=1), estimates(model, x, first, samples=6, seed=1)
    assert (a - b).abs().max() < 1e-9
    a, b = noised_estimates(model, x, samples=200, seed=1), estimates(model, x, samples=200, seed=1)
    gap = (a - b).sum(0)  # (S,) the paired difference of each sample
    assert abs(float(gap.mean())) > 3 * float(gap.std()) / math.sqrt(200)
