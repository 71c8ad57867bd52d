"""The generic properties every design must have, run over the shipped designs and over toy
designs added only through the public extension points (tests/model/toys.py, and the toy
backbone family of tests/model/toy_families.py): causality (no
position sees a later token), cached decoding equal to the full forward for a ragged batch,
a training step with finite losses, and a depth mixer that starts as the plain residual."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.core.model import NCPModel

from . import toy_families  # noqa: F401  (registers the toy backbone family "relu2")
from . import toys  # noqa: F401  (registers the toy designs)
from ._helpers import build, check_causal, check_cached_decode, ragged_batch, tiny, tokens

DESIGNS = {
    "conceptlm-neox": tiny("neox", concept={}),
    "archpreview-like-llama": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2, concept=dict(
        k=3, code_weights="softmax", add="normed", rope_scale_by_k=True)),
    # OLMo-2/3 post-norm blocks (norm on the sub-layer outputs), ArchPreview-like otherwise
    "archpreview-like-llama-post": tiny("llama", norm_placement="post", qk_norm="layer", sliding_window=3,
                                        full_attn_every=2, concept=dict(k=3, code_weights="softmax")),
    "olmo3-like-base-post": tiny("llama", norm_placement="post", qk_norm="layer", sliding_window=3,
                                 full_attn_every=2),
    "conceptlm-neox-post-parallel": tiny("neox", norm_placement="post", concept={}),
    "toy-alternating-2-3": tiny("neox", concept=dict(segmentation="alt23")),
    "toy-alternating-2-3-llama-e0": tiny("llama", sliding_window=4, concept=dict(
        segmentation="alt23", encoder_layers=0, code_weights="softmax")),
    "toy-per-token-next": tiny("llama", concept=dict(segmentation="per_token_next", add="normed")),
    "toy-dense-residual-conceptlm": tiny("neox", residual="dense", concept={}),
    "toy-dense-residual-base": tiny("llama", residual="dense", qk_norm="head"),
    "toy-dense-residual-alternating": tiny("llama", residual="dense", concept=dict(segmentation="alt23")),
    # GPT-2: learned absolute positions; concepts pooled from block 0's input (L0) or after block 0 (L1)
    "gpt2-conceptlm-l0": tiny("gpt2", tie_embeddings=True, concept=dict(encoder_layers=0, add="normed")),
    "gpt2-conceptlm-l1": tiny("gpt2", tie_embeddings=True, concept=dict(encoder_layers=1, add="normed")),
    "gpt2-base": tiny("gpt2", tie_embeddings=True),
    # the ConceptLM authors' released computation (issue 43; tests/interop/test_authors_conceptlm.py):
    # GPT-2 adds the concept through its final norm, slot 0 included; no norm before the biased heads;
    # one SimVQ transform per segment (GPT-2: a bias-free Linear, Pythia and Llama: an MLP)
    "gpt2-conceptlm-authors": tiny("gpt2", concept=dict(encoder_layers=0, add="final_norm", head_norm=False,
                                                        head_bias=True, codebook_transform="linear",
                                                        codebook_per_segment=True)),
    "llama-conceptlm-authors": tiny("llama", concept=dict(head_norm=False, head_bias=True, codebook_per_segment=True,
                                                          rope_scale_by_k=True, detach_added_concept=True)),
    # NCP-ArchPreview's dynamic residuals: IRC in every stack (the encoder has ONE layer: legal,
    # Table 8's 8/1/7 split) and all three CRC connections, at k = 2 and 4
    **{f"archpreview-irc-crc-k{k}": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
                                         residual="irc", crc_connections=["encoder-concept", "encoder-decoder",
                                                                          "concept-decoder"],
                                         concept=dict(k=k, code_weights="softmax", ncp_reduction="sum_dim"))
       for k in (2, 4)},
    "archpreview-irc-crc-mtp": tiny("llama", qk_norm="layer", residual="irc", mtp_depth=2, crc_connections=[
        "encoder-decoder", "concept-decoder"], concept=dict(k=4, code_weights="softmax")),
    "irc-softmax-crc-decoder-only-neox": tiny("neox", residual="irc", irc_normalize="softmax",
                                              crc_connections=["concept-decoder"], concept={}),
    # Table 3's IRC + input-level cross connection (crc_mode: input), at k = 2 and 4
    **{f"archpreview-irc-input-k{k}": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
                                           residual="irc", crc_mode="input", crc_connections=[
                                               "encoder-concept", "encoder-decoder", "concept-decoder"],
                                           concept=dict(k=k, code_weights="softmax"))
       for k in (2, 4)},
    # Table 3's Block AttnRes with cross-module block states, at k = 2 and 4: blocks of 2 layers over
    # 2/3/3 layers, so that stacks end on a complete and on an open block
    **{f"block-attnres-cross-k{k}": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
                                         residual="block_attnres", attnres_block=2, n_layers=5,
                                         concept=dict(k=k, encoder_layers=2, concept_layers=3))
       for k in (2, 4)},
    "block-attnres-no-cross-neox-e0": tiny("neox", residual="block_attnres", attnres_block=2, attnres_cross=False,
                                           concept=dict(encoder_layers=0)),
    "block-attnres-base-post": tiny("llama", norm_placement="post", residual="block_attnres", attnres_block=2,
                                    n_layers=4),
    # a coupling that cross-attends to the closed concepts (DLCM's way), over fixed and toy segments
    "toy-cross-attention-fixed": tiny("neox", concept=dict(coupling="cross_attend")),
    "toy-cross-attention-per-token-next": tiny("llama", concept=dict(segmentation="per_token_next",
                                                                     coupling="cross_attend")),
    "toy-cross-attention-alternating-gpt2": tiny("gpt2", tie_embeddings=True, concept=dict(
        segmentation="alt23", coupling="cross_attend", encoder_layers=1)),
    # DLCM's dynamic segmentation (random weights: boundaries wherever p >= 0.5 at inference), with the
    # addition coupling and with cross-attention; Sec. 8.1's rule-based boundaries
    "dlcm-predictor-add-llama": tiny("llama", qk_norm="layer", concept=dict(segmentation="dynamic")),
    "dlcm-predictor-cross-attend-neox": tiny("neox", concept=dict(segmentation="dynamic", coupling="cross_attend",
                                                                  balance="sequence")),
    "dlcm-boundary-rule-gpt2": tiny("gpt2", tie_embeddings=True, concept=dict(
        segmentation="dynamic", boundary_mode="boundary", boundary_tau=0.5, encoder_layers=0)),
    # DLCM's token-to-concept cross-attention (Eq. 14), over dynamic and over fixed segments
    "dlcm-cross-attention-llama": tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention")),
    "cross-attention-fixed-blocks-neox": tiny("neox", concept=dict(coupling="cross_attention")),
    # DLCM's wider concept transformer (d_concept 64 over d 32, own heads, W_up), fixed and dynamic
    "dlcm-wide-concepts-llama": tiny("llama", qk_norm="head", concept=dict(
        segmentation="dynamic", coupling="cross_attention", d_concept=64)),
    "conceptlm-wide-concepts-neox": tiny("neox", concept=dict(d_concept=64, concept_heads=4)),
    # the concept transformer's own MLP width (concept.ffn_dim), wide and at the token width
    "dlcm-concept-ffn-llama": tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention",
                                                         d_concept=64, ffn_dim=96)),
    "conceptlm-concept-ffn-neox": tiny("neox", concept=dict(ffn_dim=40)),
    "dlcm-cross-attention-replicated-llama": tiny("llama", concept=dict(
        segmentation="dynamic", coupling="cross_attention", cross_attention="replicated")),
    "cross-attention-replicated-alternating-neox": tiny("neox", concept=dict(
        segmentation="alt23", coupling="cross_attention", cross_attention="replicated")),
    # the cross sub-layer under post-norm: sequential (llama) and parallel (neox) blocks
    "toy-cross-attention-llama-post": tiny("llama", norm_placement="post", qk_norm="layer", concept=dict(
        coupling="cross_attend")),
    "toy-cross-attention-neox-post-parallel": tiny("neox", norm_placement="post", concept=dict(
        segmentation="alt23", coupling="cross_attend")),
    # a toy backbone family (tests/model/toy_families.py: ScaleNorm, squared-ReLU MLP, half rotary),
    # by name and by import path, as a base model and under the designs
    "toy-family-relu2-base": tiny("relu2"),
    "toy-family-relu2-conceptlm-irc": tiny("relu2", residual="irc", concept={}),
    "toy-family-relu2-post-gqa-window-alternating-cross": tiny(
        "tests.model.toy_families:ReLU2", norm_placement="post", n_kv_heads=2, sliding_window=3, full_attn_every=2,
        concept=dict(segmentation="alt23", coupling="cross_attend")),
}


@pytest.mark.parametrize("name", list(DESIGNS))
def test_causal(name):
    # float64: with data-dependent segments a perturbation changes the number of concepts, so the
    # (masked, causal) concept attention sums in another order: fp32 noise of ~1e-5, not a leak
    with torch.no_grad():
        check_causal(build(DESIGNS[name], scale=0.3).double(), T=13, seed=7)


@pytest.mark.parametrize("name", list(DESIGNS))
def test_cached_decode_equals_full_forward(name):
    cfg = DESIGNS[name]
    # float64: the mixers' random weights amplify fp32 summation-order noise to ~1e-4, which
    # would hide a real mismatch; in float64 the two paths agree to ~1e-13
    model = build(cfg, scale=0.2).double()
    lengths = [5, 2, 7, 4]  # left-padded to 7 slots: the rows close segments at different steps
    n_new, Tp = 12, 7
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    for max_len in (Tp + n_new, None):  # preallocated caches, and caches that grow
        with torch.no_grad():
            full = [model(seqs[b : b + 1, : n + n_new]).logits[0] for b, n in enumerate(lengths)]
        check_cached_decode(model, seqs, prompt, lengths, full, 1e-9, max_len=max_len)


@pytest.mark.parametrize("name", list(DESIGNS))
def test_training_step(name):
    cfg = DESIGNS[name]
    model = build(cfg).train()
    x = tokens(cfg, 2, 17)
    out = model(x[:, :-1], x[:, 1:])
    assert torch.isfinite(out.loss)
    keys = [k.name for k in model.log_keys()]
    assert keys[:2] == ["loss", "ntp_loss"] and set(out.losses) <= set(keys)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if cfg.concept.enabled:  # the concept path is trained through the loss
        assert model.concept.heads.weight.grad.abs().sum() > 0


def test_the_concept_path_reaches_the_decoder_only_after_a_segment_closes():
    """Alternating 2, 3: the first segment closes at token 1, the second at token 4; zeroing
    the heads (pred = 0) leaves tokens 0 unchanged and changes token 1 onwards."""
    model = build(DESIGNS["toy-alternating-2-3"], scale=0.3)
    x = tokens(model.cfg, 1, 9)
    with torch.no_grad():
        ref = model(x).logits
        model.concept.heads.weight.zero_()
        model.concept.heads.bias.zero_()
        got = model(x).logits
    assert torch.equal(got[:, :1], ref[:, :1])
    assert all((got[0, t] - ref[0, t]).abs().max() > 1e-4 for t in range(1, 9))


def test_segments_spread_by_their_closing_law():
    """The generic spread: token t gets the value of concept closed(t) - 1, zeros before."""
    from ncpctl.model import Segments
    from tests.model.toys import PerTokenNext

    cfg = DESIGNS["toy-per-token-next"]
    seg = PerTokenNext(cfg)
    h = torch.randn(1, 5, 32)
    s = seg(h)
    assert isinstance(s, Segments) and s.closed[0].tolist() == [0, 1, 2, 3, 4]
    vals = torch.arange(1.0, 6.0)[None, :, None]  # concept j has value j + 1
    assert seg.spread(s, vals, 5)[0, :, 0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("backbone", ["neox", "llama"])
def test_depth_mixer_starts_as_the_plain_residual(backbone):
    """init_weights leaves a mixer that owns its init alone: with the same other weights the
    model computes the plain residual network's logits."""
    torch.manual_seed(0)
    mixed = NCPModel(tiny(backbone, residual="dense", concept={})).eval()
    assert all(torch.all(lin.weight == 0) for lin in mixed.decoder.residual.dyn)  # not re-initialised
    plain = NCPModel(tiny(backbone, concept={})).eval()
    state = {k: v for k, v in mixed.state_dict().items() if ".residual." not in k}
    plain.load_state_dict(state)
    x = tokens(plain.cfg, 2, 11)
    with torch.no_grad():
        assert (mixed(x).logits - plain(x).logits).abs().max() <= 1e-6


@pytest.mark.parametrize("backbone,mode", [("neox", "layers"), ("llama", "layers"), ("llama", "input")])
def test_irc_and_crc_start_as_the_plain_residual_network(backbone, mode):
    """ArchPreview's IRC (last MLP layer zero + one-hot on the newest depth) and CRC (D = 0, after
    every layer or on the input) at init: the same other weights give the plain network's logits."""
    torch.manual_seed(0)
    links = ["encoder-concept", "encoder-decoder", "concept-decoder"]
    dyn = NCPModel(tiny(backbone, residual="irc", crc_connections=links, crc_mode=mode, concept={})).eval()
    plain = NCPModel(tiny(backbone, concept={})).eval()
    with torch.no_grad():  # perturb everything shared, so that the check is not trivial
        for p in dyn.parameters():
            p.add_(torch.randn_like(p) * 0.1) if p.requires_grad else None
        for mlp in dyn.decoder.residual.mlps:  # but IRC and CRC keep their init
            torch.nn.init.zeros_(mlp[2].weight), torch.nn.init.zeros_(mlp[2].bias)
        for mlp in (*dyn.encoder.residual.mlps, *dyn.concept.layers.residual.mlps):
            torch.nn.init.zeros_(mlp[2].weight), torch.nn.init.zeros_(mlp[2].bias)
        for link in dyn.crc.links.values():
            torch.nn.init.zeros_(link.scale)
    shared = {k: v for k, v in dyn.state_dict().items() if ".residual." not in k and not k.startswith("crc.")}
    plain.load_state_dict(shared)
    fresh = NCPModel(tiny(backbone, residual="irc", crc_connections=links, crc_mode=mode, concept={}))
    assert all(torch.all(m[2].weight == 0) for m in fresh.decoder.residual.mlps)  # init_weights left them alone
    assert all(torch.all(link.scale == 0) for link in fresh.crc.links.values())
    x = tokens(plain.cfg, 2, 13)
    with torch.no_grad():
        assert (dyn(x).logits - plain(x).logits).abs().max() <= 1e-6


def _link_ref(link, x: torch.Tensor, sources: list) -> torch.Tensor:
    """Eqs. 19-20 once: x + D * sum_j softmax(MLP(x))_j LN_j(S_j), from the formulas."""
    alpha = torch.softmax(link.mlps[0](x), dim=-1)
    m = sum(alpha[..., j : j + 1] * link.norms[j](s) for j, s in enumerate(sources))
    return x + link.scale[0] * m


def test_input_level_cross_connection_enters_once_on_the_target_input():
    """crc_mode: input: one MLP and one D per connection; the concept stack runs on c + CRC(c) and
    the decoder on z + CRC_enc(z) + CRC_concept(z), with no connection after any layer."""
    links = ["encoder-concept", "encoder-decoder", "concept-decoder"]
    cfg = tiny("llama", crc_connections=links, crc_mode="input", n_layers=4, concept=dict(k=2, encoder_layers=2))
    model = build(cfg, scale=0.3).double()
    assert all(len(link.mlps) == 1 and link.scale.shape == (1, 32) for link in model.crc.links.values())
    x = tokens(cfg, 2, 11)
    with torch.no_grad():
        out = model(x, return_states=True)
        cm, T = model.concept, x.shape[1]
        enc = out.states["encoder"]
        seg, pooled = cm.segment(enc[-1], enc)
        c = _link_ref(model.crc.links["encoder_concept"], seg.concepts, pooled)
        u, con = cm.layers(c, cm.context(seg.positions, c.dtype), states=True)
        assert torch.allclose(out.states["concept"][0], c, atol=1e-12)
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(out.states["concept"], con))
        spread = [cm.segmenter.spread(out.concept.segments, s, T) for s in con]
        z = _link_ref(model.crc.links["encoder_decoder"], out.concept.z, enc)
        z = _link_ref(model.crc.links["concept_decoder"], z, spread)
        ctx, _ = model.token_context(T, x.device, z.dtype)
        ref = model.head(model.final_norm(model.decoder(z, ctx)))
    assert (out.logits - ref).abs().max() <= 1e-10


def _attnres_ref(stack, x0: torch.Tensor, ctx, sources: list = ()) -> tuple[torch.Tensor, list]:
    """Block AttnRes from its formulas (Kimi Team 2026): values = sources, x0, the completed blocks'
    update sums and the open block's; each input h = sum softmax(w . (g * RMSNorm(v))) v."""
    mix = stack.residual
    S, eps = mix.block, mix.eps

    def attend(i, values):
        V = torch.stack(values, dim=-2)  # (B, T, n, d)
        keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * mix.key_weight[i]
        return (torch.softmax(keys @ mix.query[i], dim=-1)[..., None] * V).sum(-2)

    blocks, partial = [*sources, x0], None
    x = attend(0, blocks)
    for i, blk in enumerate(stack):
        update = blk(x, ctx)
        partial = update if partial is None else partial + update
        x = attend(i + 1, blocks + [partial])
        if (i + 1) % S == 0:
            blocks, partial = blocks + [partial], None
    own = blocks[len(sources):] + ([] if partial is None else [partial])
    return x, own + [x]


@pytest.mark.parametrize("name", ["block-attnres-cross-k2", "block-attnres-cross-k4", "block-attnres-base-post"])
def test_block_attnres_matches_its_reference(name):
    """The whole model against the formulas, with random pseudo-queries and key norms: each stack
    by ``_attnres_ref``; with cross-module states, the concept stack reads the encoder's states
    pooled like the concepts, the decoder the encoder's and the concept stack's spread as pred is."""
    cfg = DESIGNS[name]
    model = build(cfg, scale=0.5).double()
    x = tokens(cfg, 2, 13)
    T = x.shape[1]
    with torch.no_grad():
        got = model(x).logits
        ctx, pos = model.token_context(T, x.device, torch.float64)
        e = model.embed_tokens(x, pos)
        h, enc = _attnres_ref(model.encoder, e, ctx)
        cm, sources = model.concept, []
        z = h
        if cm is not None:
            seg = cm.segmenter(torch.cat(enc, dim=-1))
            pooled = list(seg.concepts.chunk(len(enc), dim=-1))
            seg.concepts = pooled[-1]
            u, con = _attnres_ref(cm.layers, pooled[-1], cm.context(seg.positions, torch.float64), pooled)
            z = cm.coupling(h, cm.predict(u, cm.codebook()), seg, cm.segmenter)
            sources = enc + [cm.segmenter.spread(seg, s, T) for s in con]
        y, _ = _attnres_ref(model.decoder, z, ctx, sources)
        ref = model.head(model.final_norm(y))
    assert (got - ref).abs().max() <= 1e-10
    if cm is not None:  # the cross-module states are really read: the decoder's first input has them
        assert len(sources) == model.encoder.n_depths + cm.layers.n_depths == 3 + 4  # [x0, b1, h], [c, b1, p, u]


def test_block_attnres_starts_as_a_uniform_mean_not_the_plain_residual():
    """Zero pseudo-queries (the paper's init): each input is the mean of its values, so the model
    is not the plain residual network (softmax weights sum to one; plain weights are all one)."""
    cfg = tiny("llama", residual="block_attnres", attnres_block=2, n_layers=4)
    torch.manual_seed(0)
    model = NCPModel(cfg).eval()
    mix = model.decoder.residual
    assert torch.all(mix.query == 0) and torch.all(mix.key_weight == 1)  # init_weights left them alone
    x = tokens(cfg, 2, 9)
    with torch.no_grad():
        ctx, pos = model.token_context(9, x.device, torch.float32)
        e = model.embed_tokens(x, pos)
        r0 = model.decoder[0](e, ctx)
        h1 = (e + r0) / 2  # layer 1's values are e and R_0; its input is their mean
        _, depths = model.decoder(e, ctx, states=True)
        plain = NCPModel(tiny("llama", n_layers=4)).eval()
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".residual." not in k})
        assert (plain(x).logits - model(x).logits).abs().max() > 1e-3
        r1 = model.decoder[1](h1, ctx)
    assert torch.allclose(depths[1], r0 + r1, atol=1e-6)  # block 1 = R_0 + R_1


def test_crc_needs_the_concept_path_and_a_pooling_segmentation():
    from ncpctl.model.core.config import ConfigError

    with pytest.raises(ConfigError, match="they need the concept path"):
        tiny("llama", crc_connections=["encoder-decoder"])
    with pytest.raises(ConfigError, match="encoder-concept pools every encoder depth"):
        tiny("llama", crc_connections=["encoder-concept"], concept=dict(segmentation="per_token_next"))
    with pytest.raises(ConfigError, match="must be distinct names"):
        tiny("llama", crc_connections=["encoder-nowhere"], concept={})


def test_bad_crc_mode_and_attnres_keys_are_config_errors():
    from ncpctl.model.core.config import ConfigError

    cases = [(dict(crc_mode="everywhere", crc_connections=["encoder-decoder"]), "crc_mode", "must be one of"),
             (dict(residual="block_attnres", attnres_block=0), "attnres_block", "positive integer"),
             (dict(residual="block_attnres", attnres_cross="yes"), "attnres_cross", "true or false"),
             (dict(residual="block_attnres", crc_connections=["encoder-decoder"]), "crc_connections",
              "its own cross-module"),
             (dict(residual="block_attnres", concept=dict(segmentation="per_token_next")), "attnres_cross",
              "pools_any_width")]
    for kw, key, msg in cases:
        kw = {"concept": {}, **kw}
        with pytest.raises(ConfigError) as e:
            tiny("llama", **kw)
        assert [k for k, _ in e.value.problems] == [key] and msg in str(e.value), kw


def test_unknown_or_wrong_strategies_are_config_errors():
    from ncpctl.model.core.config import ConfigError

    with pytest.raises(ConfigError, match="unknown segmentation 'nope'"):
        tiny("neox", concept=dict(segmentation="nope"))
    with pytest.raises(ConfigError, match="cannot import"):
        tiny("neox", residual="no.such.module:Mixer")
    cfg = tiny("neox", concept=dict(segmentation="tests.model.toys:Alternating23"))  # by import path
    assert cfg.num_concepts(12) == 5 and cfg.block_equivalents == 3 + 2 / 2.5


@pytest.mark.parametrize("name, width", [("dlcm-concept-ffn-llama", 96), ("conceptlm-concept-ffn-neox", 40),
                                         ("dlcm-wide-concepts-llama", None)])
def test_the_concept_transformer_has_its_own_mlp_width(name, width):
    """concept.ffn_dim sizes every concept layer's MLP (and only those); null keeps the backbone's
    rule at d_concept, so the widened design without it is unchanged."""
    cfg = DESIGNS[name]
    model = build(cfg)
    cc = cfg.concept_cfg
    expect = width if width is not None else (256 if cfg.backbone == "llama" else 4 * cc.d_model)
    assert cc.ffn_dim == expect
    widths = {n.split(".mlp.")[0]: p.shape[1] for n, p in model.named_parameters() if n.endswith("mlp.proj.weight")}
    assert {w for n, w in widths.items() if n.startswith("concept.layers.")} == {expect}
    assert {w for n, w in widths.items() if n.startswith(("encoder.", "decoder."))} == {cfg.ffn_dim}
