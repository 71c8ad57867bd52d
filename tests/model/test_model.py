"""Model structure: names the accounting relies on, parameter counts (meta device), imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ncpctl.model import NCPModel, build_config

from ._helpers import build, tiny


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_pythia_160m_parameter_count():
    with torch.device("meta"):
        model = NCPModel(build_config("pythia-160m"))
    assert _count(model) == 162_322_944
    assert model.embed.weight.numel() == model.lm_head.weight.numel() == 38_633_472
    assert len(model.encoder) == 0 and len(model.decoder) == 12 and model.concept is None


def test_archpreview_parameter_count():
    cfg = build_config("ncp-archpreview-8.9b")
    with torch.device("meta"):
        model = NCPModel(cfg)
    total = _count(model)
    assert abs(total - 8.94e9) / 8.94e9 < 0.01
    assert (len(model.encoder), len(model.concept.layers), len(model.decoder)) == (16, 8, 16)
    # the report's codebook (Sec. 2.3): S x N = 32 x 128 learned codes of d/S = 128 dims, no SimVQ transform
    assert cfg.concept.codebook == "learned"
    codebook = dict(model.concept.codebook.named_parameters())
    assert list(codebook) == ["base"] and codebook["base"].requires_grad
    assert codebook["base"].shape == (32, 128, 128) and _count(model.concept.codebook) == 524_288
    assert model.concept.heads.weight.shape == (32 * 128, 4096)
    # windows: token layer i (1-based) full when i % 4 == 0, counted across encoder+decoder
    windows = [b.attn.window for b in model.token_layers()]
    assert windows == [4096, 4096, 4096, None] * 8


def test_layer_naming_and_tying():
    cfg = tiny("neox", concept=dict(add="normed"), tie_embeddings=True)
    model = NCPModel(cfg)
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"embed", "encoder", "decoder", "concept", "final_norm"}  # lm_head tied to embed
    assert model.lm_head.weight is model.embed.weight
    for sub in ("segmenter", "layers", "norm", "heads", "codebook", "coupling"):
        assert hasattr(model.concept, sub)
    for sub in ("norm_h", "norm_pred"):  # the addition coupling's norms (add: normed)
        assert hasattr(model.concept.coupling, sub)
    assert model.token_layers()[1] is model.decoder[0]
    assert model.embed.weight.shape == (cfg.padded_vocab_size, 32) == (256, 32)


def test_config_import_does_not_need_torch():
    code = (
        "import sys; import ncpctl.model.core.config, ncpctl.model; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpt_neox_init_is_small_init_with_wang_init_outputs():
    """init: gpt-neox (Pythia): N(0, sqrt(2/(5d))) everywhere but the attention and MLP output
    projections, N(0, 2/(L sqrt(d))); zero biases, unit norms. init: hf keeps N(0, init_std)."""
    import math

    import torch

    torch.manual_seed(0)
    d, L = 256, 4
    model = NCPModel(tiny("neox", d_model=d, n_heads=4, n_layers=L, init="gpt-neox", concept={}))
    small, wang = math.sqrt(2 / (5 * d)), 2 / (L * math.sqrt(d))
    for name, p in model.named_parameters():
        if "codebook" in name:  # SimVQ: its own init (spec section 2)
            continue
        if p.ndim < 2:
            assert torch.all(p == (0 if name.endswith("bias") else 1)), name
            continue
        want = wang if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else small
        assert abs(p.std().item() / want - 1) < 0.1, (name, p.std().item(), want)
    hf = NCPModel(tiny("neox", d_model=d, n_heads=4, n_layers=L))
    assert abs(hf.decoder[0].attn.proj.weight.std().item() / 0.02 - 1) < 0.1


def test_gpt2_init_scales_the_residual_output_projections():
    """init: gpt2 = HF GPT2's _init_weights: N(0, 0.02) everywhere but the residual output
    projections (attention out-proj, MLP down-proj; GPT-2's c_proj), N(0, 0.02 / sqrt(2L)) with L
    the token layers (PM's extra layer counts), the concept layers' projections included. HF's
    own GPT2LMHeadModel of the same depth gives its c_proj that std (the formula is HF's rule)."""
    import math

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d, L = 256, 4  # 3 backbone layers + 1 extra; proj matrices of 65k-262k entries: std known to ~0.3%
    model = NCPModel(tiny("gpt2", d_model=d, n_heads=4, n_layers=3, extra_token_layers=1, init="gpt2",
                          concept=dict(encoder_layers=0, segments=4)))
    out_std = 0.02 / math.sqrt(2 * L)
    seen = {"out": 0, "concept_out": 0, "other": 0}
    for name, p in model.named_parameters():
        if p.ndim < 2 or "codebook" in name:  # norms/biases: 1/0; the codebook: its own init
            continue
        out = name.endswith(("attn.proj.weight", "mlp.proj.weight"))
        seen["concept_out" if out and name.startswith("concept.") else "out" if out else "other"] += 1
        assert p.std().item() == pytest.approx(out_std if out else 0.02, rel=0.03), name
    assert seen["out"] == 2 * L and seen["concept_out"] == 2 * 2 and seen["other"] > 0
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=L, n_embd=d, n_head=4, vocab_size=256, n_positions=64))
    for name, p in hf.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(out_std, rel=0.03), name
        elif name.endswith("c_attn.weight"):
            assert p.std().item() == pytest.approx(0.02, rel=0.03), name


def test_extra_token_layers_are_inserted_where_asked():
    """PM's extra layers at extra_token_layers_at: the base's layers keep their order around them."""
    import torch

    from ncpctl.model.families.hf import from_hf_state_dict, hf_config, to_hf_state_dict

    base = build(tiny("llama", n_layers=3))
    sd = to_hf_state_dict(base)
    pm_cfg = tiny("llama", n_layers=3, extra_token_layers=2, extra_token_layers_at=1, copy_extra_layers_from_base=True)
    assert pm_cfg.extra_layers == (1, 2) and pm_cfg.n_token_layers == 5
    ours = from_hf_state_dict(pm_cfg, sd)
    w = lambda i: ours[f"decoder.{i}.attn.qkv.weight"]  # noqa: E731  (E = 0: every token layer is decoder)
    layers = base.token_layers()
    assert torch.equal(w(0), layers[0].attn.qkv.weight)  # base layer 0 stays first
    assert torch.equal(w(1), layers[0].attn.qkv.weight) and torch.equal(w(2), layers[1].attn.qkv.weight)  # copies
    assert torch.equal(w(3), layers[1].attn.qkv.weight) and torch.equal(w(4), layers[2].attn.qkv.weight)
    fresh = from_hf_state_dict(tiny("llama", n_layers=3, extra_token_layers=2), sd)  # default: on top, fresh
    assert "decoder.3.attn.qkv.weight" not in fresh and torch.equal(fresh["decoder.2.attn.qkv.weight"],
                                                                    layers[2].attn.qkv.weight)
    assert hf_config(pm_cfg).num_hidden_layers == 5
