"""HF import: an HF directory -> NCPModel with the base's logits, with and without a concept
path (zeroed: exactly the base), concept layers copied from the base, and the round trip
checkpoint -> export -> import."""

from __future__ import annotations

import pytest
import torch
import transformers

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError
from ncpctl.interop.hf_export import export
from ncpctl.interop.hf_import import is_hf_dir, load_hf_pretrained
from ncpctl.model.families.hf import hf_config

from ..model._helpers import tiny

torch.set_num_threads(1)
CONCEPT = dict(enabled=True, k=4, encoder_layers=1, concept_layers=2, segments=4, codes=8)


def _hf_dir(tmp_path, backbone):
    cls = transformers.GPTNeoXForCausalLM if backbone == "neox" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    hf = cls(hf_config(tiny(backbone))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / backbone
    hf.save_pretrained(d)
    return hf, d


@pytest.mark.parametrize("backbone", ["neox", "llama"])
def test_import_reproduces_the_base(tmp_path, backbone):
    hf, d = _hf_dir(tmp_path, backbone)
    assert is_hf_dir(d)
    x = torch.randint(0, 200, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        base = load_hf_pretrained(d).eval()
        assert (base(x).logits - ref).abs().max() <= 1e-5
        zeroed = load_hf_pretrained(d, concept=CONCEPT, zero_concept_output=True).eval()
        assert zeroed.concept is not None and len(zeroed.encoder) == 1
        assert (zeroed(x).logits - ref).abs().max() <= 1e-5  # concept output zero -> exactly the base
        live = load_hf_pretrained(d, concept=CONCEPT).eval()
        assert (live(x).logits - ref).abs().max() > 1e-3  # a fresh concept path does change the logits


def test_concept_layers_copied_from_base(tmp_path):
    _, d = _hf_dir(tmp_path, "neox")
    m = load_hf_pretrained(d, concept={**CONCEPT, "copy_concept_layers_from_base": True})
    for j in range(2):
        ours = m.encoder[0] if j == 0 else m.decoder[j - 1]  # base layer j
        for (n, a), (_, b) in zip(m.concept.layers[j].named_parameters(), ours.named_parameters()):
            assert torch.equal(a, b), n


def test_round_trip_checkpoint_export_import(runs, tmp_path):
    export(runs["base"], tmp_path / "hf", max_shard_size="300KB")  # sharded on the way
    src = load_model(runs["base"]).model
    back = load_hf_pretrained(tmp_path / "hf").eval()
    for k, v in src.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_bad_directories(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_hf_pretrained(tmp_path)
    _, d = _hf_dir(tmp_path, "neox")
    (d / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no weights"):
        load_hf_pretrained(d)
