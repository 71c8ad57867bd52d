"""DLCM's token-to-concept cross-attention (coupling: cross_attention, Eq. 14): each declared
attention against a direct reference of itself (``per_concept``: a softmax over the closed
concepts, each once; ``replicated``: the concepts' keys/values literally copied onto the token
positions of the next segment under a causal mask), zero for tokens that see no concept, and
causality with random boundaries for both (no token sees its own unfinished segment)."""

from __future__ import annotations

import math

import pytest
import torch

from ncpctl.model.designs.cross_attention.module import CrossAttentionCoupling

from ._helpers import build, tiny, tokens


def _coupling(kind: str) -> CrossAttentionCoupling:
    torch.manual_seed(0)
    cfg = tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention", cross_attention=kind))
    cpl = CrossAttentionCoupling(cfg).double()
    with torch.no_grad():
        for p in cpl.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return cpl


def _random_closed(B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.rand(B, T, generator=g) < 0.4
    b[:, 0] = True
    return torch.cumsum(b.long(), 1) - 1  # (B, T): closed(t) = own segment index


def _heads(cpl, h, mem):
    B, T, _ = h.shape
    q = cpl.q_norm(cpl.wq(h).view(B, T, cpl.H, cpl.hd)).transpose(1, 2)  # (B, H, T, hd)
    k, v = cpl.keys_values(mem)
    return q, k, v


def _per_concept_reference(cpl, h, mem, closed):
    q, k, v = _heads(cpl, h, mem)
    B, H, T, hd = q.shape
    y = torch.zeros_like(q)
    for b in range(B):
        for t in range(T):
            n = int(closed[b, t])  # concepts 0 .. n-1, each once
            if n == 0:
                continue
            w = torch.softmax(torch.einsum("hd,hnd->hn", q[b, :, t], k[b, :, :n]) / math.sqrt(hd), dim=-1)
            y[b, :, t] = (w[..., None] * v[b, :, :n]).sum(-2)
    return cpl.wo(y.transpose(1, 2).reshape(B, T, -1))


def _replicated_reference(cpl, h, mem, closed):
    """DLCM Sec. 4.1 literally: repeat_interleave each concept's key/value over the tokens of the
    segment after it, then an ordinary causal mask over the T token-aligned keys."""
    q, k, v = _heads(cpl, h, mem)
    B, H, T, hd = q.shape
    y = torch.zeros_like(q)
    for b in range(B):
        n_seg = int(closed[b, -1]) + 1
        lengths = torch.bincount(closed[b], minlength=n_seg)  # tokens per segment
        # segment 0 carries no concept: a zero placeholder, masked below; segment i carries concept i-1
        kr = torch.repeat_interleave(torch.cat([k[b, :, :1] * 0, k[b, :, : n_seg - 1]], 1), lengths, dim=1)
        vr = torch.repeat_interleave(torch.cat([v[b, :, :1] * 0, v[b, :, : n_seg - 1]], 1), lengths, dim=1)
        has = closed[b] > 0  # (T,) the key slot holds a concept copy
        for t in range(T):
            keys = has & (torch.arange(T) <= t)
            if not keys.any():
                continue
            w = torch.softmax(torch.einsum("hd,hnd->hn", q[b, :, t], kr[:, keys]) / math.sqrt(hd), dim=-1)
            y[b, :, t] = (w[..., None] * vr[:, keys]).sum(-2)
    return cpl.wo(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("kind,reference", [("per_concept", _per_concept_reference),
                                            ("replicated", _replicated_reference)])
def test_each_attention_equals_its_direct_reference(kind, reference):
    cpl = _coupling(kind)
    B, T, d = 3, 14, 32
    closed = _random_closed(B, T, seed=5)
    M = int(closed[:, -1].max())
    h = torch.randn(B, T, d, dtype=torch.float64)
    mem = torch.randn(B, M, d, dtype=torch.float64)
    k, v = cpl.keys_values(mem)
    got = cpl.attend(h, k, v, closed)
    ref = reference(cpl, h, mem, closed)
    assert (got - ref).abs().max() <= 1e-10
    first = closed == 0  # segment 0: no concept, exactly zero, no NaN
    assert torch.equal(got[first], torch.zeros_like(got[first])) and torch.isfinite(got).all()


def test_the_two_attentions_differ():
    """Replication weighs a concept by its visible copies: not the per-concept softmax."""
    a, r = _coupling("per_concept"), _coupling("replicated")
    closed = _random_closed(2, 14, seed=5)
    M = int(closed[:, -1].max())
    h, mem = torch.randn(2, 14, 32, dtype=torch.float64), torch.randn(2, M, 32, dtype=torch.float64)
    ka, va = a.keys_values(mem)
    assert (a.attend(h, ka, va, closed) - r.attend(h, ka, va, closed)).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["per_concept", "replicated"])
@pytest.mark.parametrize("seed", [0, 1])
def test_causal_with_random_boundaries(kind, seed):
    """Training-mode boundaries (sampled, the noise fixed by the sample index): tokens after p
    change nothing at or before p, with the concepts reached only through the cross-attention."""
    cfg = tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention", cross_attention=kind,
                                     boundary_temperature=1.0))
    # float64: a different number of (masked) concepts changes fp32 summation order at ~1e-5
    model = build(cfg, seed=seed, scale=0.3).train().double()
    T = 13
    x = tokens(cfg, 1, T, seed=seed)
    ids = torch.tensor([1234 + seed])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref = model(x, sample_ids=ids)
        assert ref.concept.segments.n_closed.item() >= 2  # the check sees closed segments
        for p in range(T - 1):
            y = x.clone()
            y[:, p + 1 :] = torch.randint(0, cfg.vocab_size, (1, T - p - 1), generator=g)
            got = model(y, sample_ids=ids).logits
            assert torch.allclose(got[:, : p + 1], ref.logits[:, : p + 1], atol=1e-10, rtol=0), p


@pytest.mark.parametrize("kind", ["per_concept", "replicated"])
def test_a_token_never_sees_its_own_segments_concept(kind):
    """Perturbing the concept of token t's own segment (pred[closed(t)], the next one to close)
    changes no output of t; perturbing the latest closed one (pred[closed(t) - 1]) does."""
    cpl = _coupling(kind)
    closed = _random_closed(1, 14, seed=2)
    M = int(closed[0, -1])
    h, mem = torch.randn(1, 14, 32, dtype=torch.float64), torch.randn(1, M + 1, 32, dtype=torch.float64)

    def run(m):
        k, v = cpl.keys_values(m)
        return cpl.attend(h, k, v, closed)

    base = run(mem)
    for j in range(M + 1):
        bumped = mem.clone()
        bumped[0, j] += 1.0
        changed = (run(bumped) - base).abs().amax(-1)[0] > 1e-9  # (T,)
        assert changed.tolist() == (closed[0] > j).tolist(), j  # visible exactly once segment j closed


def test_concept_smoothing_is_causal_and_starts_as_none():
    """z~_j = z_j + s * z_{j-1}: zero s at init (a fresh model), and with s set a concept's
    smoothed value depends on itself and the one before it only."""
    from ncpctl.model.core.model import NCPModel

    cfg = tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention"))
    assert torch.equal(NCPModel(cfg).concept.coupling.smooth, torch.zeros(32))
    cpl = _coupling("per_concept")
    mem = torch.randn(2, 6, 32, dtype=torch.float64)
    z = cpl.smoothed(mem)
    assert torch.allclose(z[:, 0], mem[:, 0]) and torch.allclose(z[:, 1:], mem[:, 1:] + cpl.smooth * mem[:, :-1])
    bumped = mem.clone()
    bumped[:, 3] += 1.0
    changed = (cpl.smoothed(bumped) - z).abs().amax(-1) > 0  # (2, 6)
    assert changed[0].tolist() == [False, False, False, True, True, False]


def test_the_flash_friendly_replication_equals_the_models_replicated_attention():
    """profile-kernels' ``replicated`` row (K/V copied onto the tokens of the next segment, plain
    is_causal from segment 1 on) computes the model's replicated attention (a softmax over the
    closed concepts with log(visible copies) added): the fast path is the declared attention."""
    import torch.nn.functional as F

    closed = _random_closed(1, 30, seed=9)[0]  # (T,) own segment = closed(t)
    M, first = int(closed[-1]), int((closed == 0).sum())
    q = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    kc, vc = torch.randn(1, 2, M, 8, dtype=torch.float64), torch.randn(1, 2, M, 8, dtype=torch.float64)
    carried = closed[first:] - 1
    fast = F.scaled_dot_product_attention(q[:, :, first:], kc[:, :, carried], vc[:, :, carried], is_causal=True)
    bias = CrossAttentionCoupling.copies(closed[None], M).to(q.dtype).log()[:, None]  # (1, 1, T, M)
    model = F.scaled_dot_product_attention(q[:, :, first:], kc, vc, attn_mask=bias[:, :, first:])
    assert (fast - model).abs().max() <= 1e-12


def test_the_recipe_chooses_the_function_not_the_machine(monkeypatch):
    """``concept.cross_attention`` is the recipe's, per_concept (Eq. 14) by default: with
    ``torch.cuda.is_available`` mocked either way a recipe resolves to the same recipe, a config
    to the same function (equal logits), and a checkpoint's config written on one kind of machine
    builds that function on the other; a recorded replicated stays replicated."""
    from ncpctl.model.core.config import ModelConfig
    from ncpctl.recipe import load_recipe

    from ..conftest import RECIPES

    resolved, logits, written = {}, {}, {}
    x = tokens(tiny("llama"), 2, 24)
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        resolved[cuda] = load_recipe(RECIPES / "debug-dlcm.yaml").to_dict()
        cfg = tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention"))
        written[cuda] = cfg.to_dict()
        with torch.no_grad():
            logits[cuda] = build(cfg)(x).logits
    assert resolved[False] == resolved[True]
    assert resolved[True]["model"]["concept"]["cross_attention"] == "per_concept"
    assert written[False] == written[True] and written[True]["concept"]["cross_attention"] == "per_concept"
    assert torch.equal(logits[False], logits[True])
    replicated = {**written[True], "concept": {**written[True]["concept"], "cross_attention": "replicated"}}
    for cuda in (False, True):  # the checkpoints read back on either kind of machine
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with torch.no_grad():
            assert torch.equal(build(ModelConfig.from_dict(written[not cuda]))(x).logits, logits[cuda])
        assert build(ModelConfig.from_dict(replicated)).concept.coupling.replicated


def test_auto_is_refused_with_one_line():
    """The former ``auto`` (the machine chose the function) names the key and the two functions."""
    from ncpctl.model.core.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention", cross_attention="auto"))
    [(key, message)] = e.value.problems
    assert key == "concept.cross_attention" and "Eq. 14" in message and "replicated" in message


def test_a_model_without_cross_attention_compares_equal_to_a_checkpoint_from_before_auto():
    """Without the cross-attention coupling the key is unused and holds per_concept (the default
    every checkpoint before ``auto`` recorded), so such a checkpoint still continues or starts a
    new stage: no difference is reported."""
    from ncpctl.train.checkpoint import config_differences

    cfg = tiny("llama", concept=dict())  # ConceptLM: coupling add
    saved = cfg.to_dict()
    saved["concept"] = {**saved["concept"], "cross_attention": "per_concept"}
    assert cfg.concept.cross_attention == "per_concept"
    assert config_differences(saved, cfg.to_dict()) == []


def test_a_baseline_checkpoint_made_with_auto_on_cuda_still_continues():
    """dlcm-baseline-1.3b turns the concept path off under the 2.3B's coupling: ``auto`` recorded
    replicated there on a GPU, for a key the model never reads. The saved config, read as
    ``check_compatible`` reads it, equals the recipe's now (the unused key holds per_concept)."""
    from ncpctl.model.core.config import ModelConfig
    from ncpctl.train.checkpoint import config_differences

    cfg = tiny("llama", concept=dict(enabled=False, segmentation="dynamic", coupling="cross_attention"))
    saved = cfg.to_dict()
    saved["concept"] = {**saved["concept"], "cross_attention": "replicated"}
    assert config_differences(ModelConfig.from_dict(saved).to_dict(), cfg.to_dict()) == []


def test_replicated_runs_one_plain_causal_attention(monkeypatch):
    """The replicated form is the paper's kernel, not the per-concept softmax with a bias: one
    SDPA call over the T token-aligned keys with is_causal and no mask (what flash kernels take),
    head dim still a multiple of 8; per_concept passes its (B, 1, T, M) boolean mask."""
    import torch.nn.functional as F

    from ncpctl.model.designs.cross_attention import module as C
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((tuple(k.shape), attn_mask is None, is_causal, q.shape[-1] % 8 == 0))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(C.F, "scaled_dot_product_attention", spy)
    closed = _random_closed(2, 16, seed=3)
    M = int(closed[:, -1].max())
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, M, 8), torch.randn(2, 4, M, 8)
    C.replicated_attention(q, k, v, closed)
    C.per_concept_attention(q, k, v, closed)
    assert calls[0] == ((2, 4, 16, 16), True, True, True)  # T keys, no mask, causal
    assert calls[1][:3] == ((2, 4, M, 8), False, False)


@pytest.mark.parametrize("kind", ["per_concept", "replicated"])
def test_bf16_stays_near_the_reference_and_finite(kind):
    """In bf16 (what a GPU run uses) each form stays within bf16 rounding of its float64
    reference, and segment 0's tokens are exactly zero (the -_FAR key slots give no NaN)."""
    from ncpctl.model.designs.cross_attention import module as C
    closed = _random_closed(3, 40, seed=9)
    M = int(closed[:, -1].max())
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, n, 16, generator=g, dtype=torch.float64) for n in (40, M, M))
    form = C.replicated_attention if kind == "replicated" else C.per_concept_attention
    ref = form(q, k, v, closed)
    got = form(q.bfloat16(), k.bfloat16(), v.bfloat16(), closed).double()
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.05
    first = (closed == 0)[:, None, :, None].expand_as(got)
    assert torch.equal(got[first], torch.zeros_like(got[first]))
