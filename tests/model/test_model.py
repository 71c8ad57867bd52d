"""Model structure: names the accounting relies on, parameter counts (meta device), imports."""

from __future__ import annotations

import subprocess
import sys

import torch

from ncpctl.model import NCPModel, build_config

from ._helpers import tiny


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
    base = model.concept.codebook.base
    assert base.shape == (32, 128, 128) and base.numel() == 524_288 and not base.requires_grad
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
        "import sys; import ncpctl.model.config, ncpctl.model; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
