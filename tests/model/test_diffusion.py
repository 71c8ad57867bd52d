"""Issue 23, items 1-2: the Causal Diffusion LM objective (``model.objective: causal_diffusion``,
ncpctl/model/designs/causal_diffusion/module.py): block-causal attention (a block never sees a later block, inside a
block every position sees every other), one noisy copy whose loss counts the masked tokens only,
at their own positions, and masks keyed on (global sample index, block) so that any batch
composition (one rank or two, a resume) draws the same ones; its bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model import BlockCausal, ConfigError
from ncpctl.model.designs.causal_diffusion.module import CausalDiffusion

from ._helpers import build, tiny, tokens

BLOCK, MASK = 4, 1


def cdlm(**diffusion):
    return tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=MASK, **diffusion))


def test_objective_declares_block_causal_attention_and_uses_the_first_t_tokens():
    model = build(cdlm())
    ob = model.objective
    assert isinstance(ob, CausalDiffusion) and not ob.causal
    assert set(model.token_patterns) == {BlockCausal(BLOCK, None)}
    w = tokens(model.cfg, 2, 13)  # a data window (B, T+1)
    x, y = ob.keyed_batch(w, torch.tensor([3, 4]))
    hidden = x == MASK
    assert x.shape == y.shape == (2, 12)
    assert torch.equal(x[~hidden], w[:, :-1][~hidden])  # no shift: position p holds token p
    assert torch.equal(y[hidden], w[:, :-1][hidden]) and (y[~hidden] == -100).all()


def test_editing_block_j_leaves_the_logits_of_earlier_blocks_unchanged():
    model = build(cdlm(), scale=0.3).double()
    w = tokens(model.cfg, 1, 17)
    x, _ = model.objective.keyed_batch(w, torch.tensor([11]))  # the training form: [MASK]s in the input
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ref = model(x).logits
        for j in range(4):
            for i in range(BLOCK * j, BLOCK * j + BLOCK):  # any token of block j
                y = x.clone()
                y[0, i] = (x[0, i] + 1 + int(torch.randint(0, 50, (1,), generator=g))) % model.cfg.vocab_size
                got = model(y).logits
                assert torch.allclose(got[:, : BLOCK * j], ref[:, : BLOCK * j], atol=1e-10, rtol=0), (j, i)
                # inside its block every position sees it (bidirectional), the block's first one too
                assert not torch.allclose(got[:, BLOCK * j], ref[:, BLOCK * j], atol=1e-4), (j, i)


def test_the_loss_counts_the_masked_positions_only():
    model = build(cdlm()).train()
    w = tokens(model.cfg, 3, 17)
    x, y = model.objective.keyed_batch(w, torch.tensor([0, 7, 8]))
    hidden = y != -100
    assert 0 < hidden.sum() < y.numel()
    out = model(x, y)
    with torch.no_grad():
        logits = model(x).logits.float()
    want = F.cross_entropy(logits[hidden], w[:, :-1][hidden])  # the masked tokens at their own positions
    assert torch.allclose(out.loss, want, atol=1e-5) and list(out.losses) == ["diffusion_loss"]
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("weighting", ["masked_mean", "inverse_t"])
def test_a_micro_batch_without_masked_tokens_has_loss_zero_not_nan(weighting):
    model = build(cdlm(weighting=weighting)).train()
    x = tokens(model.cfg, 2, 8)
    out = model(x, torch.full_like(x, -100))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_elbo_weighting_is_each_masked_tokens_cross_entropy_over_its_blocks_rate():
    model = build(cdlm(weighting="inverse_t")).train()
    ob, w, ids = model.objective, tokens(model.cfg, 3, 17), torch.tensor([2, 5, 9])
    x, y = ob.keyed_batch(w, ids)
    masked, rate = ob.noise(w, ids)
    assert torch.equal(x == MASK, masked | (w[:, :-1] == MASK))
    with torch.no_grad():
        ce = F.cross_entropy(model(x).logits.float()[masked], w[:, :-1][masked], reduction="none")
    t = rate[masked].double() / (1 << 24)
    assert (t >= model.cfg.diffusion.min_t).all() and (t <= 1).all()
    want = (ce.double() / t).sum() / masked.numel()
    assert torch.allclose(model(x, y).loss.double(), want, rtol=1e-5)


def test_masks_are_keyed_on_the_sample_index_not_the_batch():
    ob = build(cdlm()).objective
    w = tokens(ob.cfg, 6, 33)
    ids = torch.tensor([40, 41, 42, 43, 44, 45])
    x, y = ob.keyed_batch(w, ids)
    # two ranks: each half of the batch on its own; and the rows in another order
    halves = [ob.keyed_batch(w[s], ids[s]) for s in (slice(0, 3), slice(3, 6))]
    assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    xp, yp = ob.keyed_batch(w[perm], ids[perm])
    assert torch.equal(xp, x[perm]) and torch.equal(yp, y[perm])
    # other samples (the same tokens) draw other masks; each block has one rate
    other, rate = ob.noise(w, ids + 1000)
    assert not torch.equal(other, ob.noise(w, ids)[0])
    blocks = rate.view(6, -1, BLOCK)
    assert (blocks == blocks[..., :1]).all() and blocks[..., 0].unique().numel() > 20
    many, _ = ob.noise(tokens(ob.cfg, 256, 33), torch.arange(256))
    assert 0.4 < many.float().mean() < 0.6  # t ~ U(0, 1): half the tokens masked on average


def test_gaussian_schedule_moves_its_mean_with_the_step():
    ob = build(cdlm(schedule="gaussian", gaussian_mean_start=0.2, gaussian_mean_end=0.7, gaussian_steps=100)).objective
    ids = torch.arange(512)
    ob.on_step_begin(0)
    early = ob.rate_units(ids, 4).double().mean() / (1 << 24)
    ob.on_step_begin(500)
    late = ob.rate_units(ids, 4).double().mean() / (1 << 24)
    assert abs(early - 0.2) < 0.03 and abs(late - 0.7) < 0.03


@pytest.mark.parametrize("over, key", [
    (dict(concept=dict(enabled=True)), "concept.enabled"),
    (dict(mtp_depth=1), "mtp_depth"),
    (dict(diffusion=dict(block_size=0, mask_id=MASK)), "diffusion.block_size"),
    (dict(diffusion=dict(schedule="cosine", mask_id=MASK)), "diffusion.schedule"),
    (dict(diffusion=dict(weighting="sum", mask_id=MASK)), "diffusion.weighting"),
    (dict(diffusion=dict(mask_id=10_000)), "diffusion.mask_id"),
])
def test_bad_configs_are_refused_by_key(over, key):
    base = dict(backbone="neox", vocab_size=200, pad_vocab_multiple=64, d_model=32, n_layers=2, n_heads=4,
                max_seq_len=64, objective="causal_diffusion", diffusion=dict(mask_id=MASK))
    with pytest.raises(ConfigError) as e:
        from ncpctl.model import ModelConfig

        ModelConfig(**{**base, **over})
    assert key in [k for k, _ in e.value.problems]


def test_block_size_must_divide_the_sequence_and_the_mask_id_must_be_known():
    cfg = cdlm()
    assert cfg.seq_len_problems(16) == [] and tiny("neox").seq_len_problems(15) == []
    assert [k for k, _ in cfg.seq_len_problems(18)] == ["train.seq_len"]
    assert cfg.special_tokens() == {"diffusion.mask_id": "<|mask|>"} and tiny("neox").special_tokens() == {}
    with pytest.raises(ValueError, match="mask_id is not set"):
        build(tiny("neox", objective="causal_diffusion"))
    ob = build(cdlm()).objective
    # generate samples block by block (item 3), eval reads its ELBO (item 4), export carries its forward (item 8)
    assert all(ob.refusal(what) is None for what in ("generate", "eval", "export")) and ob.block_sampling and ob.bound
    with pytest.raises(ValueError, match="does not decode token by token"):
        ob.decoding(None, None, None, None)


def test_profile_kernels_accounting_takes_a_cdlm():
    """The ConceptLM sibling is left out (no concept path on this objective); the concept kernels
    are timed at the recipe's shape under the default objective."""
    from ncpctl.profile.accounting import siblings
    from ncpctl.profile.kernels import _with_concept

    assert set(siblings(cdlm())) == {"recipe", "base", "pm"} and "conceptlm" in siblings(tiny("neox"))
    with_concept = _with_concept(cdlm())
    assert with_concept.concept.enabled and with_concept.objective == "next_token"


@pytest.mark.parametrize("window", [None, 6])
def test_flexattention_block_mask_equals_the_boolean_mask(monkeypatch, window):
    """On a GPU a block-causal layer runs FlexAttention with a BlockMask (patterns.kernel_masks);
    forced on here (FlexAttention's CPU forward is a reference implementation), the model's
    logits equal those of the boolean-mask SDPA path, with a window too, and the BlockMask is
    built once per shape."""
    from ncpctl.model.core import patterns
    cfg = tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=MASK),
               sliding_window=window)
    model = build(cfg, scale=0.3).eval()
    x = tokens(cfg, 2, 24)
    with torch.no_grad():
        ref = model(x).logits
        monkeypatch.setattr(patterns, "flex_enabled", lambda device: True)
        patterns._BLOCK_MASKS.clear()
        (p,) = model.token_patterns
        assert patterns.is_block_mask(patterns.kernel_masks([p], 24, x.device)[p.key])
        flex = model(x).logits
        flex_again = model(x).logits
    assert len(patterns._BLOCK_MASKS) == 1
    assert (flex - ref).abs().max() <= 1e-5 * ref.abs().max() and torch.equal(flex, flex_again)  # fp32 rounding


def test_flexattention_that_cannot_run_falls_back_to_the_boolean_mask(monkeypatch):
    """A FlexAttention failure (no Triton, an unsupported GPU) never fails the run: the layer
    uses the boolean mask, one warning says why, and FlexAttention stays off for the process."""
    from ncpctl.model.core import layers
    from ncpctl.model.core import patterns
    model = build(cdlm(), scale=0.3).eval()
    x = tokens(model.cfg, 2, 16)
    with torch.no_grad():
        ref = model(x).logits
    monkeypatch.setattr(patterns, "flex_enabled", lambda device: patterns._FLEX_OFF is None)
    monkeypatch.setattr(patterns, "_FLEX_OFF", None)

    def broken(*a, **k):
        raise RuntimeError("no Triton here\nmore")

    monkeypatch.setitem(layers._FLEX, "cpu", broken)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="FlexAttention is off for this run .RuntimeError: no Triton here"):
        out = model(x).logits
    assert torch.equal(out, ref) and patterns._FLEX_OFF is not None
    (p,) = model.token_patterns
    assert not patterns.is_block_mask(patterns.kernel_masks([p], 16, x.device)[p.key])


def test_the_1_over_t_weighting_is_named_for_what_it_is_and_refused_under_the_gaussian_curriculum():
    """Issue 41 item 4: ``weighting: elbo`` was no bound on the model as sampled (one noisy copy: each
    block conditions on noised earlier blocks) and, under ``schedule: gaussian``, no ELBO at all (1/t
    without the curriculum's 1/q(t)). It is ``inverse_t`` now (a checkpoint's old name reads as it),
    refused with gaussian by key; the validation bound defaults to 4 Monte Carlo samples (2 give an
    interval with one degree of freedom)."""
    from ncpctl.model.designs.causal_diffusion.config import DiffusionConfig

    assert cdlm(weighting="elbo").diffusion.weighting == "inverse_t"
    with pytest.raises(ConfigError) as e:
        cdlm(weighting="inverse_t", schedule="gaussian")
    (key, why), = e.value.problems
    assert key == "diffusion.weighting" and "1/q(t)" in why
    with pytest.raises(ConfigError):
        cdlm(weighting="elbo", schedule="gaussian")
    assert cdlm(schedule="gaussian").diffusion.weighting == "masked_mean"  # Steerling's pairing stays
    assert DiffusionConfig().eval_samples >= 4
