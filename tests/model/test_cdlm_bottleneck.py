"""Issue 23 item 5: Steerling's concept bottleneck on the Causal Diffusion LM (bottleneck.py's
docstring; the objective's hooks ``concept_positions``, ``fed_labels`` and ``target_tokens``): the
concept loss is the OR over each chunk's masked tokens and ignores the unmasked ones; teacher
forcing feeds a token its own block's labels; a steering stage injects at masked slots only;
attribution stays exact; a training step runs under either loss weighting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.designs.bottleneck.chunks import fed_labels
from ncpctl.model.designs.bottleneck.chunks import chunk_bce_at, held_at
from ncpctl.model.core.config import ConfigError
from ncpctl.model.core.interventions import AddToReadout

from ._helpers import build, tiny, tokens

BLOCK, MASK, N = 4, 1, 5
BN = dict(enabled=True, concepts=N, chunk=BLOCK, rank=8, dropout=0.0, teacher_forcing_start=0.0,
          teacher_forcing_end=0.0)


def cdlm_bn(weighting: str = "masked_mean", **bottleneck):
    diffusion = dict(block_size=BLOCK, mask_id=MASK, weighting=weighting)
    return tiny("llama", objective="causal_diffusion", diffusion=diffusion, bottleneck={**BN, **bottleneck})


def labels_for(B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, N, generator=g) < 0.3


def batch(model, B: int = 3, T: int = 16, ids=(3, 8, 21)):
    x, y = model.objective.keyed_batch(tokens(model.cfg, B, T + 1), torch.tensor(ids))
    return x, y, x == MASK


def reference_bce(z: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, chunk: int) -> torch.Tensor:
    """The concept loss by its definition, one chunk at a time (float64)."""
    terms = []
    for b in range(z.shape[0]):
        for s in range(0, z.shape[1], chunk):
            m = keep[b, s : s + chunk]
            if not m.any():
                continue  # no masked token: the chunk contributes nothing
            k = torch.sigmoid(z[b, s : s + chunk][m].double())
            p = 1 - (1 - k).prod(0)
            y = labels[b, s : s + chunk][m].any(0).double()
            terms.append(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
    return torch.stack(terms).mean()


def test_the_cdlm_concept_loss_ignores_unmasked_positions():
    model = build(cdlm_bn()).eval()
    x, y, keep = batch(model)
    assert 0 < keep.sum() < keep.numel()
    keep[2, :BLOCK] = False  # a chunk without a masked token (it must contribute nothing, not NaN)
    x[2, :BLOCK] = torch.where(x[2, :BLOCK] == MASK, 2, x[2, :BLOCK])
    y[2, :BLOCK] = -100
    assert torch.equal(model.objective.concept_positions(x, y), keep)
    labels = labels_for(3, 16)
    out = model(x, y, concept_labels=labels, return_bottleneck=True)
    loss = out.losses["concept_loss"]
    z = out.bottleneck.k_logits
    assert torch.allclose(loss.double(), reference_bce(z, labels, keep, BLOCK), rtol=1e-5)
    # the labels at unmasked positions never enter it
    flipped = torch.where(keep[..., None], labels, ~labels)
    assert torch.equal(model(x, y, concept_labels=flipped).losses["concept_loss"], loss)
    # nor the states there (the bottleneck fed other states at the unmasked positions)
    h = torch.randn(3, 16, model.cfg.d_model, generator=torch.Generator().manual_seed(4))
    h2 = torch.where(keep[..., None], h, h * 3 + 1)
    bn = model.bottleneck
    a = bn(h, labels, losses=True, positions=keep)["losses"]["concept_loss"]
    assert torch.equal(bn(h2, labels, losses=True, positions=keep)["losses"]["concept_loss"], a)
    # a masked position's label does: a chunk whose masked tokens carry no concept 0 gains one
    chunk_or = (labels & keep[..., None]).view(3, -1, BLOCK, N).any(2)  # (B, C, n) the masked tokens' OR
    b, t = next((b, t) for b, t in keep.nonzero().tolist() if not chunk_or[b, t // BLOCK, 0])
    more = labels.clone()
    more[b, t, 0] = True
    assert not torch.allclose(model(x, y, concept_labels=more).losses["concept_loss"], loss)
    # no masked token at all: 0 with finite gradients, not the empty mean's NaN
    zd = z.detach().requires_grad_()
    zero = chunk_bce_at(zd, labels, BLOCK, torch.zeros_like(keep))
    zero.backward()
    assert zero.item() == 0.0 and torch.equal(zd.grad, torch.zeros_like(zd))
    chunk_bce_at(zd, labels, BLOCK, keep).backward()  # the empty chunk of row 2 gets no gradient, no NaN
    assert torch.isfinite(zd.grad).all() and (zd.grad[2, :BLOCK] == 0).all() and (zd.grad[keep] != 0).any()


def test_the_ar_bottleneck_reads_every_position():
    """The next-token objective keeps the AR rules: every position, the chunk before's labels."""
    model = build(tiny("neox", bottleneck=BN))
    x = tokens(model.cfg, 2, 8)
    labels = labels_for(2, 8)
    assert model.objective.concept_positions(x, x) is None
    assert torch.equal(model.objective.fed_labels(labels, 4), fed_labels(labels, 4))


def test_cdlm_teacher_forcing_feeds_the_own_blocks_labels():
    """With chunks of 2 inside blocks of 4, a token's fed labels are the OR of its own block's tokens
    (later tokens of the block included: the block is generated jointly), never a later block's."""
    model = build(cdlm_bn(chunk=2, teacher_forcing_start=1.0, teacher_forcing_end=1.0)).train()
    x, y, _ = batch(model, B=2, T=12, ids=(5, 6))
    labels = torch.zeros(2, 12, N, dtype=torch.bool)
    labels[0, 3, 1] = True  # the last token of block 0
    labels[0, 9, 2] = True  # block 2
    labels[1, 4, 4] = True  # block 1
    want = torch.zeros(2, 12, N)
    want[0, 0:4, 1] = want[0, 8:12, 2] = want[1, 4:8, 4] = 1
    assert torch.equal(model.objective.fed_labels(labels, 2), want)
    model.on_step_begin(0)  # alpha = 1: every chunk teacher-forced
    k = model(x, y, concept_labels=labels, return_bottleneck=True).bottleneck.k
    assert torch.equal(k, want)


def test_cdlm_steering_injects_at_masked_slots_only():
    """The steering stage's direction lands on masked positions only (Steerling's mask-aligned
    injection), those whose chunk's masked tokens carry the drawn concept; in the forward too."""
    model = build(cdlm_bn(respond_weight=1.0, steer_fraction=1.0, steer_strength=3.0, steer_at="readout")).train()
    x, y, keep = batch(model)
    labels = labels_for(3, 16, seed=2)
    torch.manual_seed(1)
    inj = model.bottleneck.injection(labels, model.logit_weight, keep)
    held = held_at(labels, BLOCK, keep)
    rows = torch.arange(3)
    assert (inj.concept >= 0).all()
    assert torch.equal(inj.where, held[rows, :, inj.concept])  # masked slots of chunks whose masked tokens carry c
    assert inj.where.any() and not (inj.where & ~keep).any()
    assert not torch.equal(inj.where, (labels[rows, :, inj.concept]))  # not the AR slots: unmasked ones drop
    torch.manual_seed(1)
    out = model(x, y, concept_labels=labels, return_bottleneck=True)
    assert torch.equal(out.bottleneck.steer.abs().sum(-1) > 0, inj.where)
    assert torch.isfinite(out.losses["respond_loss"])


def test_cdlm_attribution_is_exact():
    """logit = known + unknown + residual (+ steering), per concept too, on a CDLM's noisy input."""
    model = build(cdlm_bn(), scale=0.2).eval()
    x, _, _ = batch(model)
    v = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    for ivs in (None, [AddToReadout(vector=v)]):
        with torch.no_grad():
            out = model(x, return_bottleneck=True, interventions=ivs)
        tok = out.logits.argmax(-1)
        att = model.bottleneck.attribute(out.bottleneck, model.logit_weight, tok)
        logit = out.logits.gather(-1, tok[..., None])[..., 0]
        assert (att.logit - logit).abs().max() <= 1e-4
        assert (att.per_concept.sum(-1) - att.known).abs().max() <= 1e-4
        assert (att.steering.abs().max() > 0) == (ivs is not None)


@pytest.mark.parametrize("weighting", ["masked_mean", "inverse_t"])
def test_a_cdlm_bottleneck_training_step_has_finite_gradients(weighting):
    model = build(cdlm_bn(weighting, teacher_forcing_start=0.5, teacher_forcing_end=0.5, dropout=0.1)).train()
    x, y, keep = batch(model)
    out = model(x, y, concept_labels=labels_for(3, 16))
    assert {"diffusion_loss", "concept_loss", "reconstruction_loss", "independence_loss"} <= set(out.losses)
    share = out.metrics["concept_share"]  # read at the target tokens (elbo targets carry their rate)
    assert 0 <= share.item() <= 1
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert model.bottleneck.known.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(g).all() for g in grads)


def test_a_chunk_must_divide_the_diffusion_block():
    assert cdlm_bn(chunk=2).bottleneck.chunk == 2  # divides: accepted (no refusal of the bottleneck)
    with pytest.raises(ConfigError) as e:
        cdlm_bn(chunk=3)
    assert [k for k, _ in e.value.problems] == ["bottleneck.chunk"]
    assert "must divide model.diffusion.block_size=4" in str(e.value)


def test_held_out_detection_reads_the_masked_tokens():
    """Validation's concept detection scores the chunks with a masked token, as the loss reads them."""
    from ncpctl.train.designs.bottleneck import chunk_detection

    model = build(cdlm_bn()).eval()
    x, y, keep = batch(model)
    labels = labels_for(3, 16, seed=5)
    out = model(x, y, concept_labels=labels, return_bottleneck=True)
    scores, got = chunk_detection(model.cfg, out, labels)
    chunks = keep.view(3, 4, BLOCK).any(-1)
    assert scores.shape == got.shape == (int(chunks.sum()), N)
    masked_or = (labels & keep[..., None]).view(3, 4, BLOCK, N).any(2)
    assert torch.equal(got.bool(), masked_or[chunks])
    z = out.bottleneck.k_logits.float()
    p = 1 - torch.where(keep[..., None], 1 - torch.sigmoid(z), torch.ones_like(z)).view(3, 4, BLOCK, N).prod(2)
    assert torch.allclose(scores, p[chunks], atol=1e-6)
    assert F.mse_loss(scores, p[chunks]) < 1e-10
