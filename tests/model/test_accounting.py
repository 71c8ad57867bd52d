"""Cost accounting: ConceptLM App. C and NCP-ArchPreview Table 2 reproduced, exact FLOPs by
hand on small shapes, parameter counts from the real module on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ncpctl.model.accounting.flops import (
    PARAM_GROUPS,
    count_parameters,
    describe,
    exact_flops,
    paper_flops,
    parameter_equivalent_layers,
    saving,
)
from ncpctl.model.core.config import build_config

T_APPC, D_APPC = 8192, 4096


def _appc_base(**kw):
    # A 32-layer backbone at the App. C width; only d, layer counts and k enter the formula.
    return build_config("pythia-160m", d_model=D_APPC, n_layers=32, n_heads=32, max_seq_len=T_APPC, **kw)


@pytest.fixture(scope="module")
def pm():
    return _appc_base(extra_token_layers=2)


@pytest.fixture(scope="module")
def conceptlm():
    return _appc_base(concept=dict(enabled=True, k=4, encoder_layers=1, concept_layers=2))


@pytest.fixture(scope="module")
def archpreview():
    return build_config("ncp-archpreview-8.9b")


# ---- paper view ------------------------------------------------------------------------


def test_appc_pm_formula(pm):
    f = paper_flops(pm, T_APPC)
    assert pm.n_token_layers == 34
    assert (f.coef_Td2, f.coef_T2d) == (408, 68)
    assert f.formula == "408*T*d^2 + 68*T^2*d"
    T, d = T_APPC, D_APPC
    assert f.forward_per_sequence == 408 * T * d**2 + 68 * T**2 * d
    assert f.training_per_sequence == 3 * f.forward_per_sequence
    assert f.training_formula == "1224*T*d^2 + 204*T^2*d"
    assert f.forward_per_token == f.forward_per_sequence / T


def test_appc_conceptlm_formula_and_saving(pm, conceptlm):
    f = paper_flops(conceptlm, T_APPC)
    assert (f.token_layers, f.concept_layers, f.k) == (32, 2, 4)
    assert (f.coef_Td2, f.coef_T2d) == (390, 64.25)
    assert f.formula == "390*T*d^2 + 64.25*T^2*d"
    T, d = T_APPC, D_APPC
    assert f.forward_per_sequence == 390 * T * d**2 + 64.25 * T**2 * d
    assert f.training_per_sequence == 3 * f.forward_per_sequence
    base = paper_flops(pm, T_APPC)
    assert saving(base.forward_per_sequence, f.forward_per_sequence) == 0.046875  # 4.6875%
    assert saving(base.training_per_sequence, f.training_per_sequence) == 0.046875


def test_archpreview_table2(archpreview):
    cfg = archpreview
    assert cfg.n_token_layers == 32  # the base model's depth
    assert (cfg.encoder_layers, cfg.concept.concept_layers, cfg.decoder_layers) == (16, 8, 16)
    f = paper_flops(cfg)
    assert f.block_equivalents == 34 == 16 + 8 / 4 + 16  # PM-equivalent compute
    assert f.parameter_equivalent_layers == parameter_equivalent_layers(cfg) == 40
    assert f.block_equivalents / f.parameter_equivalent_layers == 0.85
    assert f.coef_Td2 == 12 * 34


def test_paper_view_without_concept_path():
    cfg = build_config("pythia-160m")
    f = paper_flops(cfg, 2048)
    assert (f.coef_Td2, f.coef_T2d, f.concept_layers, f.k) == (144, 24, 0, None)
    assert f.block_equivalents == 12 and f.parameter_equivalent_layers == 12


# ---- exact view ------------------------------------------------------------------------


def test_exact_pythia_by_hand():
    cfg = build_config("pythia-160m")
    T, d, V, L = 2048, 768, 50304, 12
    e = exact_flops(cfg, T)
    c = e.components
    assert c["token_layers.qkv"] == L * 2 * T * d * 3 * d
    assert c["token_layers.attn_out"] == L * 2 * T * d * d
    assert c["token_layers.mlp"] == L * 2 * T * d * 4 * d * 2  # GELU: 2 matrices of 4d
    assert c["token_layers.attention"] == L * 4 * T * T * d
    assert e.attention_causal["token_layers.attention"] == L * 4 * d * T * (T + 1) // 2
    assert c["lm_head"] == 2 * T * d * V
    assert e.forward_per_sequence == L * (24 * T * d**2 + 4 * T**2 * d) + 2 * T * d * V
    assert e.training_per_sequence == 3 * e.forward_per_sequence
    assert e.forward_per_token == e.forward_per_sequence / T
    assert e.concept_share == 0 and e.concept_positions == 0 and e.training_only == {}


def test_exact_gqa_swiglu_sliding_window():
    cfg = build_config("llama-debug", concept=dict(enabled=True))  # d=64, 4 heads, 2 kv heads, ffn 176, window 32, every 2nd full
    T, d, hd = 64, 64, 16
    e = exact_flops(cfg, T)
    L = cfg.n_token_layers
    assert e.components["token_layers.qkv"] == L * 2 * T * d * (d + 2 * 2 * hd)
    assert e.components["token_layers.mlp"] == L * 2 * T * d * 176 * 3
    # layers 2 and 4 full (T keys per query), 1 and 3 windowed (32 keys per query)
    assert e.components["token_layers.attention"] == 4 * d * (2 * T * T + 2 * T * 32)
    swa_causal = 32 * 33 // 2 + (T - 32) * 32
    assert e.attention_causal["token_layers.attention"] == 4 * d * (2 * T * (T + 1) // 2 + 2 * swa_causal)
    # concept layers run on M = 16 positions < window: all full
    assert e.concept_positions == 16
    assert e.components["concept_layers.attention"] == 2 * 4 * 16 * 16 * d


def test_exact_concept_path_by_hand():
    cfg = build_config("debug", concept=dict(enabled=True))  # d=64, k=4, C=2, S=4, N=16
    T, d, S, N, ds, M = 256, 64, 4, 16, 16, 64
    e = exact_flops(cfg, T)
    c = e.components
    assert c["concept.pooling"] == M * 4 * d
    assert c["concept.heads"] == 2 * M * d * S * N
    assert c["concept.codebook_einsum"] == 2 * M * S * N * ds
    assert c["concept.codebook_transform"] == 2 * S * N * (ds * 2 * ds + 2 * ds * ds)
    assert c["concept_layers.mlp"] == 2 * 2 * M * d * 4 * d * 2
    assert e.training_only == {"concept.vq_quantise": 2 * M * S * N * ds}
    assert e.training_per_sequence == 3 * e.forward_per_sequence + e.training_only["concept.vq_quantise"]
    assert 0 < e.concept_share < 1 and 0 < e.concept_share_causal < 1
    # the codebook transform runs once per step, not per sequence or token
    e_long = exact_flops(cfg, 2 * T)
    assert e_long.components["concept.codebook_transform"] == c["concept.codebook_transform"]
    e_b4 = exact_flops(cfg, T, batch_size=4)
    tr = c["concept.codebook_transform"]
    assert e_b4.forward_per_step() == 4 * (e.forward_per_step() - tr) + tr
    assert e_b4.forward_per_sequence < e.forward_per_sequence
    # a learned codebook has no transform
    learned = exact_flops(build_config("debug", concept=dict(enabled=True, codebook="learned")), T)
    assert learned.components["concept.codebook_transform"] == 0


def test_exact_trailing_partial_block_not_pooled():
    cfg = build_config("debug", concept=dict(enabled=True))
    e = exact_flops(cfg, 10)
    assert e.concept_positions == 2
    assert e.components["concept.pooling"] == 2 * 4 * 64


@pytest.mark.parametrize("which", ["pm", "conceptlm", "archpreview"])
def test_exact_covers_paper_layer_terms(which, request):
    cfg = request.getfixturevalue(which)
    p, e = paper_flops(cfg), exact_flops(cfg)
    assert e.layer_flops >= p.forward_per_sequence
    assert e.components["lm_head"] == 2 * cfg.max_seq_len * cfg.d_model * cfg.padded_vocab_size
    assert e.forward_per_sequence >= e.layer_flops + e.components["lm_head"]
    assert e.forward_per_sequence_causal < e.forward_per_sequence
    assert e.training_per_token >= 3 * e.forward_per_token


def test_archpreview_exact_numbers(archpreview):
    e = exact_flops(archpreview)  # T = 8192, window 4096 on 3 of every 4 token layers
    T, d = 8192, 4096
    assert e.components["token_layers.attention"] == 4 * d * T * (8 * T + 24 * 4096)
    assert e.concept_positions == 2048
    assert e.components["concept.heads"] == 2 * 2048 * d * 32 * 128
    assert 0.01 < e.concept_share < 0.25


def test_to_dict_is_json():
    cfg = build_config("debug", concept=dict(enabled=True))
    acc = describe(cfg, seq_len=64, params=False)
    d = json.loads(json.dumps(acc.to_dict()))
    assert d["params"] is None
    assert d["paper"]["formula"] == paper_flops(cfg, 64).formula
    assert d["exact"]["forward_per_sequence"] == exact_flops(cfg, 64).forward_per_sequence


def test_import_does_not_need_torch():
    code = "import sys, ncpctl.model.accounting.flops; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- parameter counts (the real NCPModel on the meta device) ---------------------------


def _check_sums(p):
    assert set(p.components) == set(PARAM_GROUPS)
    assert sum(p.components.values()) == p.total


def test_params_pythia_160m_base():
    p = count_parameters(build_config("pythia-160m"))
    _check_sums(p)
    assert p.total == 162_322_944
    assert p.trainable == p.total
    assert p.components["embeddings"] == 38_633_472
    assert p.components["lm_head"] == 38_633_472
    assert p.total - p.components["embeddings"] - p.components["lm_head"] == 85_056_000
    for g in ("concept_layers", "concept_heads", "codebook", "codebook_transform"):
        assert p.components[g] == 0


def test_params_archpreview():
    cfg = build_config("ncp-archpreview-8.9b")
    p = count_parameters(cfg)
    _check_sums(p)
    assert abs(p.total - 8.94e9) / 8.94e9 < 0.01
    assert p.components["codebook"] == 524_288 == 128 * 4096  # learned codes (S, N, d/S), Sec. 2.3
    assert p.trainable == p.total and p.components["codebook_transform"] == 0  # no SimVQ transform
    assert p.components["concept_heads"] >= 4096 * 32 * 128
    assert p.components["embeddings"] == p.components["lm_head"] == 100352 * 4096
    # concept layers are token layers' shape: 8 of them vs 32
    assert p.components["concept_layers"] * 4 == pytest.approx(p.components["token_layers"], rel=1e-3)


def test_params_debug_concept_sums_and_describe():
    cfg = build_config("debug", concept=dict(enabled=True))
    acc = describe(cfg, seq_len=64)
    p = acc.params
    _check_sums(p)
    assert p.components["codebook"] == 4 * 16 * 16
    assert p.trainable == p.total - p.components["codebook"]
    assert json.loads(json.dumps(acc.to_dict()))["params"]["total"] == p.total


@pytest.mark.parametrize("size,count", [("gpt2-124m", 124_439_808), ("gpt2-355m", 354_823_168),
                                        ("gpt2-774m", 774_030_080), ("gpt2-1.5b", 1_557_611_200)])
def test_gpt2_parameter_counts_equal_hf(size, count):
    """The GPT-2 sizes hold HF's parameters at vocab 50257 (tied embeddings, 1024 positions);
    the padded count (vocab 50304) is reported beside it."""
    cfg = build_config(size)
    p = count_parameters(cfg)
    assert p.unpadded_total == count
    assert p.total == count + (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model  # tied: one padded matrix
    if size == "gpt2-124m":  # and the HF model itself, built on the meta device
        import torch
        import transformers

        with torch.device("meta"):
            hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        assert sum(t.numel() for t in hf.parameters()) == count


def test_dynamic_residuals_are_counted():
    """IRC and CRC parameters land in their own group; their matmul FLOPs are exact components
    (the MLPs and the weighted sums) and their share is reported."""
    links = ["encoder-concept", "encoder-decoder", "concept-decoder"]
    plain = build_config("debug", concept=dict(enabled=True))
    dyn = build_config("debug", residual="irc", crc_connections=links, concept=dict(enabled=True))
    p0, p1 = count_parameters(plain), count_parameters(dyn)
    assert p0.components["dynamic_residuals"] == 0 < p1.components["dynamic_residuals"]
    assert p1.total - p0.total == p1.components["dynamic_residuals"]
    d, h, E, C, D = 64, 32, 1, 2, 3
    irc = sum(d * h + h + h * (i + 2) + (i + 2) for n in (E, C, D) for i in range(n))  # Linear(d,h), Linear(h,i+2)
    crc = sum(n * (d * h + h + h * K + K) + K * 2 * d + n * d for K, n in ((E + 1, C), (E + 1, D), (C + 1, D)))
    assert p1.components["dynamic_residuals"] == irc + crc
    e0, e1 = exact_flops(plain, 64), exact_flops(dyn, 64)
    T, M = 64, 16
    want_irc = sum(2 * P * (d * h + h * (i + 2)) + 2 * P * (i + 2) * d for n, P in ((E, T), (C, M), (D, T))
                   for i in range(n))
    assert e1.components["residual.irc"] == want_irc
    assert e0.residual_share == 0 < e1.residual_share  # ~6% at d=64; at 8.9B it is ~0.1%:
    big = build_config("ncp-archpreview-8.9b", residual="irc", crc_connections=links)
    assert 0 < exact_flops(big, 8192).residual_share < 0.002


def test_input_level_crc_and_block_attnres_are_counted():
    """crc_mode: input has one MLP and one D per connection and counts one target layer's CRC
    (``residual.crc_input``); Block AttnRes has a pseudo-query and a key-norm weight per query
    (n + 1 per stack) and counts 4 V d per position and query over V values (``residual.attnres``),
    the cross-module states among them. Both are in the parameter group and in residual_share."""
    links = ["encoder-concept", "encoder-decoder", "concept-decoder"]
    d, h, E, C, D, T, M = 64, 32, 1, 2, 3, 64, 16
    irc_cfg = build_config("debug", residual="irc", concept=dict(enabled=True))
    inp = build_config("debug", residual="irc", crc_connections=links, crc_mode="input", concept=dict(enabled=True))
    irc = sum(d * h + h + h * (i + 2) + (i + 2) for n in (E, C, D) for i in range(n))
    crc = sum(d * h + h + h * K + K + K * 2 * d + d for K in (E + 1, E + 1, C + 1))  # one MLP, K LNs, D (1, d)
    assert count_parameters(inp).components["dynamic_residuals"] == irc + crc
    e = exact_flops(inp, T)
    want = sum(2 * P * (d * h + h * K) + 2 * P * K * d + 2 * P * d for K, P in ((E + 1, M), (E + 1, T), (C + 1, T)))
    assert e.components["residual.crc_input"] == want and "residual.crc" not in e.components
    layers = build_config("debug", residual="irc", crc_connections=links, concept=dict(enabled=True))
    assert exact_flops(irc_cfg, T).residual_share < e.residual_share < exact_flops(layers, T).residual_share

    ar = build_config("debug", residual="block_attnres", attnres_block=2, concept=dict(enabled=True))
    p = count_parameters(ar)
    assert p.components["dynamic_residuals"] == 2 * d * ((E + 1) + (C + 1) + (D + 1))
    assert p.total - count_parameters(build_config("debug", concept=dict(enabled=True))).total == 2 * d * 9
    # values per query (blocks of 2): encoder [x0] then [x0, p]; the concept stack reads the
    # encoder's 3 states [x0, b1 (open), h]; the decoder those 3 and the concept stack's 3
    V = {"encoder": ([1, 2], T), "concept": ([4, 5, 5], M), "decoder": ([7, 8, 8, 9], T)}
    e = exact_flops(ar, T)
    assert e.components["residual.attnres"] == sum(4 * P * v * d for vs, P in V.values() for v in vs)
    assert e.residual_share == pytest.approx(e.components["residual.attnres"] / e.forward_per_sequence, rel=1e-12)
    alone = build_config("debug", residual="block_attnres", attnres_block=2, attnres_cross=False,
                         concept=dict(enabled=True))
    V = {"encoder": ([1, 2], T), "concept": ([1, 2, 2], M), "decoder": ([1, 2, 2, 3], T)}
    assert exact_flops(alone, T).components["residual.attnres"] == \
        sum(4 * P * v * d for vs, P in V.values() for v in vs)


# ---- the backward of a stage that freezes weights (adapt-vq, LoRA): what MFU counts ----


def _stage_model(size: str, stage: str, **concept):
    """The real model of ``size`` set up as ``stage`` (full: nothing frozen but the SimVQ base)."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.stages import freeze_all_but_codebook

    torch.manual_seed(0)
    model = NCPModel(build_config(size, concept=dict(enabled=True, **concept)))
    if stage == "vq":
        freeze_all_but_codebook(model)
    elif stage == "lora":
        pytest.importorskip("peft")
        from ncpctl.recipe.schema import LoraSection
        from ncpctl.train.lora import apply_lora

        apply_lora(model, LoraSection(rank=3))
    return model


def _trainable(model):
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("size,extra", [("debug", {}), ("llama-debug", {}), ("ncp-archpreview-8.9b", {}),
                                        ("debug", dict(residual="irc", crc_connections=[
                                            "encoder-concept", "encoder-decoder", "concept-decoder"])),
                                        ("debug", dict(residual="irc", crc_mode="input", crc_connections=[
                                            "encoder-decoder", "concept-decoder"])),
                                        ("llama-debug", dict(residual="block_attnres", attnres_block=2))])
def test_backward_with_every_weight_trained_is_the_3x_convention(size, extra):
    from ncpctl.model.core.config import build_config as bc

    cfg = bc(size, concept=dict(enabled=True), **extra)
    names = {n: 1 for n in _meta_names(cfg)}
    for T in (64, 256):
        full, every = exact_flops(cfg, T, 3), exact_flops(cfg, T, 3, trainable=names)
        for causal in (False, True):
            assert every.training_per_step(causal) == full.training_per_step(causal)
            assert every.backward_per_step(causal) == 2 * full.forward_per_step(causal)


def _meta_names(cfg):
    import torch

    from ncpctl.model.core.model import NCPModel

    with torch.device("meta"):
        return [n for n, _ in NCPModel(cfg).named_parameters()]


@pytest.mark.parametrize("stage", ["full", "vq", "lora"])
@pytest.mark.parametrize("size,concept", [("debug", {}), ("llama-debug", {}), ("debug", {"codebook": "learned"})])
def test_stage_training_flops_equal_torchs_flop_counter(size, concept, stage):
    """One forward + backward of the real stage, its matmuls counted by torch's FlopCounterMode
    (SDPA's math kernel, so attention is counted as matmuls): exact_flops with the stage's
    trainable parameters gives the same number, but for what only one side counts (pooling's
    adds here, the ncp_code_acc metric's nearest-code search there)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = _stage_model(size, stage, **concept)
    cfg, T, B = model.cfg, 32, 2
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x).loss.backward()
    e = exact_flops(cfg, T, B, trainable=_trainable(model))
    S, N, ds, M = cfg.n_segments, cfg.concept.codes, cfg.segment_dim, e.concept_positions
    pooling = B * (e.components["concept.pooling"] + e.backward["concept.pooling"])
    metric = B * 2 * (M - 1) * S * N * ds
    assert counter.get_total_flops() == e.training_per_step() - pooling + metric
    assert ("adapters" in e.components) == (stage == "lora")


@pytest.mark.parametrize("trained", ["all", "frozen_body"])
def test_mtp_training_flops_equal_torchs_flop_counter(trained):
    """The MTP head (two depths) in the training count: forward + backward of the real model under
    FlopCounterMode equals exact_flops, with every weight trained and with only the head trained."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ncpctl.model.core.model import NCPModel

    torch.manual_seed(0)
    cfg = build_config("debug", mtp_depth=2)
    model, T, B = NCPModel(cfg), 32, 2
    if trained == "frozen_body":
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("mtp."))
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x).loss.backward()
    e = exact_flops(cfg, T, B, trainable=_trainable(model))
    assert {k for k in e.components if k.startswith("mtp.")} == {"mtp.proj", "mtp.layers", "mtp.attention",
                                                                  "mtp.lm_head"}
    assert counter.get_total_flops() == e.training_per_step()
    if trained == "all":
        assert e.training_per_step() == exact_flops(cfg, T, B).training_per_step()


def test_table8_mtp_adds_the_papers_flops():
    """Table 8: one MTP depth adds 0.505e21 (OLMo-3-3B) / 0.504e21 (NCP) of 3.2e21 at 150B tokens."""
    dense = dict(d_model=3328, n_heads=16, ffn_dim=13312, n_layers=15, vocab_size=100278, max_seq_len=8192,
                 concept=dict(enabled=True, encoder_layers=8, concept_layers=4))
    base, mtp = build_config("ncp-archpreview-8.9b", **dense), build_config("ncp-archpreview-8.9b", mtp_depth=1, **dense)
    extra = (exact_flops(mtp).training_per_token_causal - exact_flops(base).training_per_token_causal) * 150e9
    assert extra == pytest.approx(3.731e21 - 3.227e21, rel=0.03)


def test_adapt_vq_at_8_9b_backward_is_the_decoders_input_gradients():
    """adapt-vq (learned codebook): NTP's gradient reaches the heads through the decoder, so the
    decoder and LM head compute input gradients (no weight gradients); the heads a weight
    gradient only; the mix both operands; the encoder and concept layers nothing."""
    from ncpctl.model.accounting.flops import _stack_flops

    cfg = build_config("ncp-archpreview-8.9b", concept=dict(codebook="learned"))
    T = 8192
    trainable = {"concept.heads.weight": 16_777_216, "concept.codebook.base": 524_288}
    e, full = exact_flops(cfg, T, 1, trainable=trainable), exact_flops(cfg, T, 1)
    dec = _stack_flops(cfg, cfg.token_windows[16:], T)
    c = e.components
    want = (dec["qkv"] + dec["attn_out"] + dec["mlp"] + 2 * dec["attention"] + c["lm_head"]
            + c["concept.heads"] + 2 * c["concept.codebook_einsum"])
    assert e.backward_per_step() == want
    assert e.forward_per_step() == full.forward_per_step()
    # the training FLOPs MFU counts: about half of full fine-tuning's at this shape
    assert 0.45 < e.training_per_step() / full.training_per_step() < 0.55


def test_exact_flops_at_a_realised_ratio():
    """DLCM's concepts are counted at the target R (T // R); ``realised_ratio`` counts them at a
    measured tokens per concept instead: the same as the model with R replaced, parameters unchanged."""
    from ncpctl.model.accounting.flops import at_realised_ratio

    cfg = build_config("debug", concept=dict(enabled=True, segmentation="dynamic", coupling="cross_attention",
                                             target_ratio=4))
    at = exact_flops(cfg, 256, realised_ratio=3.2)
    same = exact_flops(build_config("debug", concept=dict(enabled=True, segmentation="dynamic",
                                                          coupling="cross_attention", target_ratio=3.2)), 256)
    assert at.concept_positions == 80 == 256 * 10 // 32 and at.components == same.components
    assert exact_flops(cfg, 256).concept_positions == 64 and at.forward_per_token > exact_flops(cfg, 256).forward_per_token
    assert paper_flops(cfg, 256, realised_ratio=3.2).k == 3.2 and paper_flops(cfg, 256).k == 4
    assert at_realised_ratio(cfg, None) is cfg and cfg.concept.target_ratio == 4  # cfg untouched
    assert count_parameters(at_realised_ratio(cfg, 3.2)).total == count_parameters(cfg).total
    with pytest.raises(ValueError, match="> 1"):
        exact_flops(cfg, 256, realised_ratio=1.0)
    with pytest.raises(ValueError, match="dynamic"):
        exact_flops(build_config("debug", concept=dict(enabled=True)), 256, realised_ratio=3.0)


def test_a_realised_ratio_of_t_over_m_counts_m_concepts():
    """A sequence that realised M concepts, passed as the ratio T / M, is counted at M: the float
    T / (T / M) is 12.999.. for M = 13 at T = 32, which a plain floor made 12."""
    cfg = build_config("debug", concept=dict(enabled=True, segmentation="dynamic"))
    for T in (32, 100, 8192):
        assert [exact_flops(cfg, T, realised_ratio=T / M).concept_positions for M in range(1, T // 2)] == \
            list(range(1, T // 2))


def test_a_design_slots_parameters_are_their_own_group():
    """The segmentation's, the coupling's (its module and its sub-layer in each decoder block) and
    the MTP head's parameters are counted as theirs: DLCM's boundary predictor and cross-attention
    were 'norms_other' (14.2M of dlcm-2.3b's), and so was the MTP head."""
    import torch

    from ncpctl.model.accounting.params import _param_group
    from ncpctl.model.core.model import NCPModel

    from . import toys  # noqa: F401  (registers the toy coupling with a decoder sub-layer)

    d = 64
    dlcm = build_config("debug", mtp_depth=1, concept=dict(enabled=True, segmentation="dynamic",
                                                           coupling="cross_attention"))
    toy = build_config("debug", concept=dict(enabled=True, coupling="cross_attend"))
    for cfg in (dlcm, toy):
        with torch.device("meta"):
            model = NCPModel(cfg)
        own = lambda keep: sum(p.numel() for n, p in model.named_parameters() if keep(n))  # noqa: E731
        c = count_parameters(cfg).components
        assert c["coupling"] == own(lambda n: n.startswith("concept.coupling.") or ".cross" in n) > 0
        assert c["segmentation"] == own(lambda n: n.startswith("concept.segmenter."))
        assert c["mtp"] == own(lambda n: n.startswith("mtp."))
        other = [n for n, _ in model.named_parameters() if _param_group(n) == "norms_other"]
        assert other and all("norm" in n for n in other), other  # nothing but norms is left over
    assert count_parameters(dlcm).components["segmentation"] == 2 * d * d and count_parameters(dlcm).components["mtp"] > 0
