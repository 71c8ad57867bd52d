"""The concept path against the spec (sections 1-3): shift table, causality, losses and
where their gradients go, codebook, metrics, one training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.core.concept import nearest_code, shift_blocks
from ncpctl.model.core.config import build_config
from ncpctl.model.core.model import NCPModel

from ._helpers import build, check_causal, tiny, tokens


def _capture(model):
    """Hooks recording h (encoder output, with grad) and z (decoder input)."""
    seen = {}

    def keep_h(_m, _inp, out):
        out.retain_grad()
        seen["h"] = out

    def keep_z(_m, args):
        seen["z"] = args[0]

    if len(model.encoder):
        model.encoder.register_forward_hook(keep_h)  # the encoder stack's output
    model.decoder.register_forward_pre_hook(keep_z)
    return seen


def test_shift_table_k4_literal():
    pred = torch.arange(1, 4, dtype=torch.float).view(1, 3, 1).expand(1, 3, 2)  # pred[j] = j+1
    s = shift_blocks(pred, 4, 11)[0, :, 0].tolist()
    assert s == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # p=0,1,2 -> 0; 3..6 -> pred[0]; 7..10 -> pred[1]
    assert shift_blocks(pred, 4, 12)[0, :, 0].tolist() == s + [3]  # p=11 ends block 2 -> pred[2]
    # repeat_interleave form of the spec
    ref = torch.cat([torch.zeros(1, 1, 2), pred], 1).repeat_interleave(4, dim=1)[:, 1:12]
    assert torch.equal(shift_blocks(pred, 4, 11), ref)


def test_model_adds_shifted_pred():
    """z = h + shift(pred) inside the model, with the k=4 table, T=11 (trailing partial block)."""
    model = build(tiny("neox", concept={}))
    seen = _capture(model)
    out = model(tokens(model.cfg, 2, 11))
    h, z, pred = seen["h"], seen["z"], out.pred
    assert pred.shape == (2, 2, 32)
    added = z - h
    assert torch.all(added[:, 0:3] == 0)
    torch.testing.assert_close(added[:, 3:7], pred[:, 0:1].expand(2, 4, 32))
    torch.testing.assert_close(added[:, 7:11], pred[:, 1:2].expand(2, 4, 32))
    # pooling: c[j] = mean(h[j*k : j*k+k]); pred comes from the concept stack on c
    c = h.reshape(2, -1, 32)[:, :8].reshape(2, 2, 4, 32).mean(2)
    cm = model.concept
    from ncpctl.model.core.layers import Context, causal_masks, rope

    cos, sin = rope(torch.arange(2)[None], model.cfg, h.dtype)
    u = cm.layers(c, Context(cos, sin, causal_masks({None}, 2, c.device)))
    torch.testing.assert_close(cm.predict(u, cm.codebook()), pred)


CAUSAL_VARIANTS = {
    "neox-conceptlm": ("neox", {}),
    # every other switch that touches the decoder input: E=0, normed add, softmax, scaled RoPE, SWA
    "llama-archpreview-like": ("llama", dict(encoder_layers=0, add="normed", code_weights="softmax",
                                             rope_scale_by_k=True)),
}


@pytest.mark.parametrize("variant", list(CAUSAL_VARIANTS))
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_causality(k, variant):
    backbone, concept = CAUSAL_VARIANTS[variant]
    extra = dict(sliding_window=3, full_attn_every=2, qk_norm="layer") if backbone == "llama" else {}
    cfg = tiny(backbone, concept=dict(k=k, **concept), **extra)
    model = build(cfg, scale=0.3)
    check_causal(model, T=13, seed=k)  # T = 13: not a multiple of 2, 4, 8


def test_heads_are_one_matmul_equal_to_segment_heads():
    cfg = tiny("llama", concept=dict(code_weights="softmax"))
    cm = build(cfg).concept
    S, N, d, ds = 4, 8, 32, 8
    assert isinstance(cm.heads, torch.nn.Linear) and cm.heads.weight.shape == (S * N, d)
    u = torch.randn(2, 3, d)
    codes = cm.codebook()
    ref = []
    un = cm.norm(u)
    for s in range(S):  # S separate heads, each with its own codebook segment
        w = F.linear(un, cm.heads.weight[s * N : (s + 1) * N]).softmax(-1)  # (B, M, N)
        ref.append(w @ codes[s])  # (B, M, ds)
    torch.testing.assert_close(cm.predict(u, codes), torch.cat(ref, -1))


def test_codebook_simvq_and_learned():
    cfg = tiny("neox", concept={})
    cb = NCPModel(cfg).concept.codebook
    assert cb.base.shape == (4, 8, 8) and not cb.base.requires_grad
    assert [type(m).__name__ for m in cb.transform] == ["Linear", "ReLU", "Linear"]
    assert cb.transform[0].weight.shape == (16, 8) and cb.transform[2].weight.shape == (8, 16)
    assert abs(cb.base.std().item() - 8**-0.5) < 0.1
    assert "concept.codebook.base" in NCPModel(cfg).state_dict()
    learned = NCPModel(tiny("neox", concept=dict(codebook="learned"))).concept.codebook
    assert learned.base.requires_grad and learned.transform is None


def test_losses_match_the_formulas():
    for red in ("mean", "sum_dim"):
        cfg = tiny("neox", concept=dict(ncp_reduction=red, ncp_weight=0.5, vq_weight=2.0))
        model = build(cfg)
        seen = _capture(model)
        x = tokens(cfg, 2, 18)
        y = tokens(cfg, 2, 18, seed=5)
        out = model(x, y)
        h, pred, codes = seen["h"], out.pred, model.concept.codebook()
        c = h[:, :16].reshape(2, 4, 4, 32).mean(2)
        err = (pred[:, :-1] - c[:, 1:]) ** 2
        ncp = err.mean() if red == "mean" else err.sum(-1).mean()
        idx = nearest_code(c, codes)
        q = torch.stack([codes[s][idx[..., s]] for s in range(4)], 2).reshape(2, 4, 32)
        vq = ((c - q) ** 2).mean()  # the codebook term; the commitment term (0.25 x it) is logged apart
        logits = model(x).logits
        ntp = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        torch.testing.assert_close(out.ncp_loss, ncp)
        torch.testing.assert_close(out.vq_loss, vq)
        torch.testing.assert_close(out.commitment_loss, 0.25 * vq)
        torch.testing.assert_close(out.ntp_loss, ntp)
        torch.testing.assert_close(out.loss, ntp + 0.5 * ncp + 2.0 * 1.25 * vq)
        # metrics: shapes and ranges; accuracy = nearest code of pred == of the next block
        assert out.code_usage.shape == out.code_perplexity.shape == out.ncp_code_acc.shape == (4,)
        assert torch.all((out.code_usage > 0) & (out.code_usage <= 1))
        assert torch.all((out.code_perplexity >= 1) & (out.code_perplexity <= 8 + 1e-4))
        acc = (nearest_code(pred[:, :-1], codes) == idx[:, 1:]).float().mean((0, 1))
        torch.testing.assert_close(out.ncp_code_acc, acc)
        used = torch.tensor([len(set(idx[..., s].flatten().tolist())) / 8 for s in range(4)])
        torch.testing.assert_close(out.code_usage, used)


# The published normalisations (NCP-ArchPreview, shared/papers/001: Sec. 2.7, Algorithm 1), written
# out on (B, M, S, ds) tensors: ||x||^2 of a segment is the sum over its ds elements.
def _ncp_formula(pred, c, how, S):
    """pred (B, M, d) predicts c (B, M, d) one block on; the mean over the batch of each row's loss."""
    B, M, d = c.shape
    seg = ((pred[:, :-1] - c[:, 1:]) ** 2).reshape(B, M - 1, S, d // S).sum(-1)  # (B, M-1, S) ||.||^2
    if how == "mean":  # ConceptLM: the element mean
        return ((pred[:, :-1] - c[:, 1:]) ** 2).mean()
    if how == "sum_dim":  # Eq. 22: 1/(M-1) sum_{m>=2} ||c^_m - sg(c_m)||^2 (the whole d-vector)
        return (seg.sum(-1).sum(-1) / (M - 1)).mean()
    # Algorithm 1 line 21: 1/((M-1) S) sum_{m>=2} sum_s ||c^_m^s - sg(c_m^s)||^2
    return (seg.sum((-1, -2)) / ((M - 1) * S)).mean()


def _vq_formula(c, q, how, S):
    """The codebook term (the commitment term, logged apart, is commitment x it: c is detached at
    the VQ input)."""
    B, M, d = c.shape
    if how == "mean":
        return ((c - q) ** 2).mean()
    # Eq. 21: 1/(M S) sum_m sum_s ||sg(c_m^s) - d_m^s||^2
    return (((c - q) ** 2).reshape(B, M, S, d // S).sum(-1).sum((-1, -2)) / (M * S)).mean()


@pytest.mark.parametrize("vq", ["mean", "sum_segment"])
@pytest.mark.parametrize("ncp", ["mean", "sum_dim", "sum_segment"])
def test_each_reduction_equals_its_formula(ncp, vq):
    cfg = tiny("llama", concept=dict(ncp_reduction=ncp, vq_reduction=vq, commitment=0.3))
    model = build(cfg)
    seen = _capture(model)
    x = tokens(cfg, 2, 20)
    out = model(x, x)
    c, codes = seen["h"].reshape(2, 5, 4, 32).mean(2), model.concept.codebook()
    idx = nearest_code(c, codes)
    q = torch.stack([codes[s][idx[..., s]] for s in range(4)], 2).reshape(2, 5, 32)
    torch.testing.assert_close(out.ncp_loss, _ncp_formula(out.pred, c, ncp, 4))
    torch.testing.assert_close(out.vq_loss, _vq_formula(c, q, vq, 4))
    torch.testing.assert_close(out.commitment_loss, 0.3 * _vq_formula(c, q, vq, 4))


@pytest.mark.parametrize("vq", ["mean", "sum_segment"])
@pytest.mark.parametrize("ncp", ["mean", "sum_dim", "sum_segment"])
def test_each_reduction_skips_padding_concepts(ncp, vq):
    """Rows with padding concepts (Segments.valid): each loss is its formula over the real concepts
    (NCP: the pairs whose both blocks are real), averaged over them."""
    from ncpctl.model.core.concept import ConceptOutput, Segments

    cfg = tiny("neox", concept=dict(ncp_reduction=ncp, vq_reduction=vq))
    concept = build(cfg).concept
    g = torch.Generator().manual_seed(3)
    c, pred = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out = ConceptOutput(z=c)
    with torch.no_grad():
        codes = concept.codebook()
        concept._losses(Segments(concepts=c, positions=torch.arange(5)[None], valid=valid), pred, codes, out)
    # the same formulas, row by row over the real concepts, then weighted by their counts
    rows = [(c[:1], pred[:1]), (c[1:, :3], pred[1:, :3])]
    pairs = torch.tensor([4.0, 2.0])
    ncp_rows = torch.stack([_ncp_formula(p, x, ncp, 4) for x, p in rows])
    torch.testing.assert_close(out.losses["ncp_loss"], (ncp_rows * pairs).sum() / pairs.sum())
    idx = nearest_code(c, codes)
    q = torch.stack([codes[s][idx[..., s]] for s in range(4)], 2).reshape(2, 5, 32)
    vq_rows = torch.stack([_vq_formula(c[:1], q[:1], vq, 4), _vq_formula(c[1:, :3], q[1:, :3], vq, 4)])
    real = torch.tensor([5.0, 3.0])
    torch.testing.assert_close(out.losses["vq_loss"], (vq_rows * real).sum() / real.sum())
    torch.testing.assert_close(out.losses["commitment_loss"], 0.25 * (vq_rows * real).sum() / real.sum())


def test_default_reductions_are_the_previous_expressions_bit_for_bit():
    """ncp mean / sum_dim and vq mean compute exactly what they computed before the options (vq:
    its codebook term; the commitment term is logged apart since, commitment x that term)."""
    from ncpctl.model.core.concept import ConceptOutput, Segments

    for ncp in ("mean", "sum_dim"):
        concept = build(tiny("neox", concept=dict(ncp_reduction=ncp))).concept
        g = torch.Generator().manual_seed(4)
        c, pred = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
        for valid in (None, torch.tensor([[True] * 5, [True, True, True, False, False]])):
            out = ConceptOutput(z=c)
            with torch.no_grad():
                codes = concept.codebook()
                concept._losses(Segments(concepts=c, positions=torch.arange(5)[None], valid=valid), pred, codes, out)
            err = (pred[:, :-1] - c[:, 1:]) ** 2
            per = err.sum(-1) if ncp == "sum_dim" else err.mean(-1)
            idx = nearest_code(c, codes)
            q = codes[torch.arange(4), idx].reshape(2, 5, 32)
            if valid is None:
                want_ncp = err.mean() if ncp == "mean" else per.mean()
                want_vq = F.mse_loss(q, c)
            else:
                pair = valid[:, :-1] & valid[:, 1:]
                want_ncp = (per * pair).sum() / pair.sum().clamp_min(1)
                m = valid[..., None].float()
                want_vq = ((q - c) * m).pow(2).sum() / (valid.sum() * 32)
            assert torch.equal(out.losses["ncp_loss"], want_ncp) and torch.equal(out.losses["vq_loss"], want_vq)
            assert torch.equal(out.losses["commitment_loss"], 0.25 * want_vq)


@pytest.mark.parametrize("vq", ["mean", "sum_segment"])
def test_commitment_term_has_no_gradient(vq):
    """With c detached at the VQ input the commitment weight changes the value, never a gradient
    (of the whole training loss)."""
    grads = {}
    for beta in (0.0, 0.25):
        model = build(tiny("neox", concept=dict(commitment=beta, vq_reduction=vq)))
        x = tokens(model.cfg, 2, 16)
        model(x, x).loss.backward()
        grads[beta] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[0.0].keys() == grads[0.25].keys() and grads[0.0]
    assert all(torch.equal(grads[0.0][n], grads[0.25][n]) for n in grads[0.0])


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def test_vq_loss_trains_only_the_codebook_transform():
    model = build(tiny("neox", concept={}))
    x = tokens(model.cfg, 2, 16)
    model(x, x).vq_loss.backward()
    g = _grads(model)
    assert g and all(n.startswith("concept.codebook.transform.") for n in g)
    assert len(g) == 4  # both Linears, weights and biases


def test_ncp_target_carries_no_gradient():
    model = build(tiny("neox", concept={}))
    seen = _capture(model)
    x = tokens(model.cfg, 2, 18)  # M = 4 blocks, 2 trailing tokens
    out = model(x, x)
    out.ncp_loss.backward()
    gh = seen["h"].grad.abs().sum(-1)  # (B, T)
    assert torch.all(gh[:, :12] > 0)  # blocks 0..2 feed pred[0..2] through the concept stack
    assert torch.all(gh[:, 12:] == 0)  # block 3 is only a target (detached); trailing tokens unused
    g = _grads(model)
    for name in ("concept.heads.weight", "concept.layers.0.attn.qkv.weight", "concept.codebook.transform.0.weight",
                 "encoder.0.attn.qkv.weight", "embed.weight"):
        assert name in g, name
    assert not any(n.startswith(("decoder.", "lm_head", "final_norm")) for n in g)


@pytest.mark.parametrize("detach", [False, True])
def test_ntp_reaches_concept_heads_unless_detached(detach):
    model = build(tiny("neox", concept=dict(detach_added_concept=detach)))
    x = tokens(model.cfg, 2, 16)
    model(x, x).ntp_loss.backward()
    g = _grads(model)
    assert ("concept.heads.weight" in g) == (not detach)
    assert ("concept.codebook.transform.2.weight" in g) == (not detach)
    assert "encoder.0.mlp.fc.weight" in g and "decoder.0.mlp.fc.weight" in g


@pytest.mark.parametrize("T", [1, 3, 4, 7])
def test_fewer_than_two_blocks(T):
    """M = T // 4 < 2: no NCP target; the step still runs and backpropagates."""
    model = build(tiny("neox", concept={}))
    x = tokens(model.cfg, 2, T)
    out = model(x, x)
    assert out.ncp_loss.item() == 0 and out.ncp_code_acc is None
    assert torch.isfinite(out.loss)
    out.loss.backward()
    if T < 4:
        assert out.vq_loss.item() == 0 and out.code_usage is None


@pytest.mark.parametrize("variant", [
    dict(),
    dict(add="normed", code_weights="softmax", rope_scale_by_k=True, encoder_layers=0),
    dict(codebook="learned", ncp_reduction="sum_dim"),
])
def test_variants_run(variant):
    for backbone in ("neox", "llama"):
        model = build(tiny(backbone, concept=variant))
        x = tokens(model.cfg, 2, 17)
        out = model(x, x)
        out.loss.backward()
        assert model(x).logits.shape == (2, 17, 256) and torch.isfinite(out.loss)


def test_normed_add_and_e0():
    model = build(tiny("llama", concept=dict(add="normed", encoder_layers=0)))
    assert len(model.encoder) == 0 and len(model.decoder) == 3
    seen = _capture(model)
    x = tokens(model.cfg, 1, 9)
    out = model(x)
    h = model.embed(x)  # E = 0 pools the embeddings
    cm = model.concept
    want = cm.coupling.norm_h(h) + shift_blocks(cm.coupling.norm_pred(out.pred), 4, 9)
    torch.testing.assert_close(seen["z"], want)
    assert torch.equal(seen["z"][:, :3], cm.coupling.norm_h(h)[:, :3])  # nothing added before block 0 ends


def test_one_step_lowers_the_loss():
    torch.manual_seed(0)
    cfg = build_config("debug", concept=dict(enabled=True))
    model = NCPModel(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    before = model(x[:, :-1], x[:, 1:])
    before.loss.backward()
    opt.step()
    after = model(x[:, :-1], x[:, 1:])
    assert after.loss.item() < before.loss.item()
    assert after.ntp_loss.item() < before.ntp_loss.item()


def test_linear_code_weights_are_raw_head_outputs():
    """`linear` (ConceptLM reference): the head outputs multiply the codebook unnormalised;
    `softmax` (NCP-ArchPreview): per-segment convex weights."""
    cm = build(tiny("neox", concept=dict(code_weights="linear"))).concept
    u = torch.randn(2, 3, 32)
    codes = cm.codebook()
    w = cm.heads(cm.norm(u)).view(2, 3, 4, 8)  # (B, M, S, N), no normalisation
    want = torch.stack([w[:, :, s] @ codes[s] for s in range(4)], 2).reshape(2, 3, 32)
    torch.testing.assert_close(cm.predict(u, codes), want)
    assert not torch.allclose(w.sum(-1), torch.ones(2, 3, 4))  # really unnormalised here


@pytest.mark.parametrize("codebook", ["simvq", "learned"])
def test_codebook_base_init_std(codebook):
    """Gaussian base with std d_seg**-0.5 (spec 2), also after NCPModel's own init."""
    cfg = tiny("neox", concept=dict(codes=64, codebook=codebook))  # S=4, N=64, d_seg=8: 2048 values
    base = NCPModel(cfg).concept.codebook.base
    assert abs(base.std().item() - 8**-0.5) < 0.03
    assert abs(base.mean().item()) < 0.03


# Where the published designs disagree (spec 1-3): each is a recipe key under model.concept,
# with the spec's default (ConceptLM unless the spec says otherwise).
SPEC_DEFAULTS = dict(
    k=4, encoder_layers=1, concept_layers=2, codes=64, segments=None, codebook="simvq", code_weights="linear",
    add="raw", detach_added_concept=False, ncp_reduction="mean", vq_reduction="mean", ncp_weight=1.0, vq_weight=1.0,
    commitment=0.25, rope_scale_by_k=False,
)


def test_design_choices_are_keys_with_spec_defaults(tmp_path):
    from ncpctl.model.core.config import ConceptConfig
    from ncpctl.recipe import load_recipe

    defaults = ConceptConfig()
    assert {k: getattr(defaults, k) for k in SPEC_DEFAULTS} == SPEC_DEFAULTS
    cfg = build_config("pythia-160m", concept=dict(enabled=True))
    assert (cfg.n_segments, cfg.segment_dim) == (12, 64)  # S defaults to n_heads
    # each is settable from a recipe (the model section is generated from ModelConfig)
    r = tmp_path / "r.yaml"
    r.write_text("model: {size: debug, concept: {enabled: true}}\n")
    other = dict(k=2, encoder_layers=0, concept_layers=1, codes=8, segments=2, codebook="learned",
                 code_weights="softmax", add="normed", detach_added_concept=True, ncp_reduction="sum_dim",
                 vq_reduction="sum_segment", ncp_weight=0.5, vq_weight=2.0, commitment=0.5, rope_scale_by_k=True)
    assert set(other) == set(SPEC_DEFAULTS)
    got = load_recipe(r, [f"model.concept.{k}={str(v).lower() if isinstance(v, bool) else v}"
                          for k, v in other.items()]).model_config.concept
    assert {k: getattr(got, k) for k in other} == other


def test_commitment_term_is_logged_apart():
    """vq_loss = ||sg(c) - q||^2 alone, whatever the commitment weight; commitment_loss =
    commitment x ||c - sg(q)||^2 (c detached: commitment x vq_loss), its own log key, in the total
    with vq_weight."""
    outs = {}
    for beta in (0.0, 0.25, 1.0):
        model = build(tiny("neox", concept=dict(commitment=beta, vq_weight=2.0)))  # same seed: same weights
        x = tokens(model.cfg, 2, 16)
        outs[beta] = model(x, x)
        assert [k.name for k in model.log_keys()][2:5] == ["ncp_loss", "vq_loss", "commitment_loss"]
    vq = outs[0.0].vq_loss
    for beta, out in outs.items():
        assert torch.equal(out.vq_loss, vq)
        torch.testing.assert_close(out.commitment_loss, beta * vq)
        torch.testing.assert_close(out.loss - outs[0.0].loss, 2.0 * beta * vq)
    assert outs[0.0].commitment_loss.item() == 0


@pytest.mark.parametrize("size", ["debug", "llama-debug", "pythia-70m", "pythia-160m", "pythia-410m",
                                  "ncp-archpreview-8.9b"])
def test_every_size_as_base_pm_and_conceptlm(size):
    """The paper's three-way comparison is one key apart for every named size."""
    base = build_config(size, concept=dict(enabled=False))
    pm = build_config(size, concept=dict(enabled=False), extra_token_layers=2)
    clm = build_config(size, concept=dict(enabled=True))
    assert pm.n_token_layers == base.n_token_layers + 2 == clm.n_token_layers + 2
    assert not base.concept.enabled and clm.concept.enabled
    assert clm.encoder_layers + clm.decoder_layers == base.n_token_layers
