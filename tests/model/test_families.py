"""Backbone families as records (ncpctl/model/families/base.py): a toy family added only through the
public API (tests/model/toy_families.py) gets its defaults, its own checks and its norm and MLP
in every block and stack, by name and by import path; a family without a Hugging Face model is
refused by name on export and import; an unknown family is a ConfigError naming ``backbone``.
The generic design properties (causality, cached decoding, a training step) run over the toy in
tests/model/test_designs.py, exact resume through the CLI in tests/train/test_toy_family_cli.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ncpctl.model import ConfigError, Family, ModelConfig
from ncpctl.model.families.hf import config_from_hf, from_hf_state_dict, hf_config, hf_model_types, to_hf_state_dict
from ncpctl.model.core.layers import MLP, RMSNorm

from . import toy_families as toy
from ._helpers import build, tiny, tokens


@pytest.mark.parametrize("name", ["relu2", "tests.model.toy_families:ReLU2"])
def test_the_toy_family_builds_every_norm_and_mlp_from_its_record(name):
    cfg = tiny(name, concept=dict(add="normed"), mtp_depth=1)
    # its defaults fill the keys left null; set keys win
    assert (cfg.ffn_dim, cfg.rotary_dim, cfg.bias, cfg.parallel_residual, cfg.learned_positions) == (96, 4, False,
                                                                                                     False, False)
    assert tiny(name, ffn_dim=40, bias=True).ffn_dim == 40 and tiny(name, bias=True).bias
    model = build(cfg)
    norms = [m for m in model.modules() if isinstance(m, (toy.ScaleNorm, nn.LayerNorm, RMSNorm))]
    mlps = [m for m in model.modules() if isinstance(m, (toy.ReLU2MLP, MLP))]
    blocks = 3 + 2 + 1  # token, concept and MTP layers
    # per block 2 norms; the final and the concept stack's norm, the coupling's two (add: normed), MTP's two
    assert len(norms) == 2 * blocks + 1 + 1 + 2 + 2 and all(isinstance(m, toy.ScaleNorm) for m in norms)
    assert len(mlps) == blocks and all(isinstance(m, toy.ReLU2MLP) for m in mlps)
    stacks = [model.encoder, model.decoder, model.concept.layers, model.mtp.depths[0].layer]
    assert sum(len(s) for s in stacks) == blocks and all(isinstance(b, toy.GainBlock) for s in stacks for b in s)
    x = torch.randn(2, 5, 32)
    blk = model.decoder[0].mlp
    assert torch.allclose(blk(x), blk.proj(torch.relu(blk.fc(x)) ** 2))


def test_the_family_check_and_unknown_families_are_config_errors():
    with pytest.raises(ConfigError) as e:
        tiny("relu2", parallel_residual=True)
    assert e.value.problems == [("parallel_residual", "relu2 blocks are sequential")]
    with pytest.raises(ConfigError) as e:
        tiny("mamba")
    assert e.value.problems[0][0] == "backbone" and "'mamba'" in e.value.problems[0][1]
    assert "gpt2, llama, neox" in e.value.problems[0][1] and "relu2" in e.value.problems[0][1]
    with pytest.raises(ConfigError) as e:
        tiny("tests.model.toy_families:ScaleNorm")  # a class that is not a Family
    assert e.value.problems[0][0] == "backbone" and "not a Family subclass" in e.value.problems[0][1]


def test_a_family_without_a_hugging_face_model_is_refused_by_name():
    cfg = tiny("relu2")
    with pytest.raises(ConfigError) as e:
        hf_config(cfg)
    assert e.value.problems == [("backbone", "'relu2' has no Hugging Face model (its family declares no HF mapping)")]
    for convert in (lambda: to_hf_state_dict(build(cfg)), lambda: from_hf_state_dict(cfg, {})):
        with pytest.raises(ConfigError, match="backbone: 'relu2' has no Hugging Face model"):
            convert()
    assert hf_model_types() == ("gpt_neox", "llama", "qwen3", "olmo2", "olmo3", "gpt2")  # relu2 imports none


def test_a_registered_family_can_import_hugging_face_models():
    """A family that declares HF model types takes them over from ``config_from_hf``."""
    from transformers import GPT2Config

    from ncpctl.model import register
    from ncpctl.model.core.config import STRATEGIES

    class Fake:
        model_type = "toy_lm"

        def to_dict(self):
            return {"model_type": "toy_lm", "width": 32}

    class Importer(toy.ReLU2):
        hf_model_types = ("toy_lm",)
        hf_read = {"toy_lm": {"width"}}

        def from_hf(self, hf):
            return dict(backbone="toy_importer", vocab_size=200, d_model=hf.to_dict()["width"], n_layers=2, n_heads=4)

    register("backbone", "toy_importer", Importer)
    try:
        assert "toy_lm" in hf_model_types()
        cfg = config_from_hf(Fake())
        assert (cfg.backbone, cfg.d_model, cfg.ffn_dim) == ("toy_importer", 32, 96)
        assert isinstance(build(cfg).decoder[0].mlp, toy.ReLU2MLP)
        assert config_from_hf(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64)).backbone == "gpt2"
    finally:
        del STRATEGIES["backbone"]["toy_importer"]
    assert issubclass(Importer, Family)


def test_old_configs_keep_their_backbone_values():
    """Each built-in family's defaults are the values the config computed before families were records."""
    for name, want in (("neox", (128, 2, True, True)), ("gpt2", (128, 0, True, False)), ("llama", (256, 8, False, False))):
        cfg = ModelConfig(backbone=name, vocab_size=200, d_model=32, n_layers=2, n_heads=4)
        assert (cfg.ffn_dim, cfg.rotary_dim, cfg.bias, cfg.parallel_residual) == want, name
        assert cfg.learned_positions == (name == "gpt2")
    assert torch.isfinite(build(tiny("relu2")).eval()(tokens(tiny("relu2"), 1, 7)).logits).all()


@pytest.mark.parametrize("name", ["neox", "llama", "gpt2", "relu2"])
def test_mlp_matrices_counts_the_mlp_weights(name):
    """The torch-free count the cost model reads is the built MLP's (d x ffn_dim matrices)."""
    from ncpctl.model.registry import family

    cfg = tiny(name)
    mlp = build(cfg).decoder[0].mlp
    weights = sum(p.numel() for n, p in mlp.named_parameters() if n.endswith("weight"))
    assert weights == family(name).mlp_matrices * cfg.d_model * cfg.ffn_dim


def test_the_built_in_families_travel_with_exported_code():
    """Exported remote code imports the built-in families (the registry's import paths, flattened)."""
    from ncpctl.interop import hf_export

    files = {p.name for p in hf_export.remote_files()}
    assert {"families_base.py", "families_neox.py", "families_llama.py", "families_gpt2.py"} <= files
