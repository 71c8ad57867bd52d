"""The plain-PyTorch reference of bench/gpu_check.py (ncpctl/profile/reference.py) computes the same
function as an ncpctl Pythia base model with the same weights, so "ours / reference" compares
training loops, not models; only a plain GPT-NeoX base model converts. Its compiled training step
runs in bench/gpu_check.py --dry (tests/profile/test_gpu_check.py), where it must learn."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.core.config import build_config
from ncpctl.model.core.model import NCPModel
from ncpctl.profile.reference import RefGPT
from ncpctl.profile.step import next_token_batch

torch.set_num_threads(1)


def test_reference_equals_ncpctl_pythia() -> None:
    cfg = build_config("debug", max_seq_len=32)
    torch.manual_seed(0)
    ours = NCPModel(cfg).eval()
    with torch.no_grad():  # random norms and biases too: a wrong mapping cannot hide behind ones and zeros
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref = RefGPT.from_ncp(ours).eval()
    x, y = next_token_batch(cfg, 2, 32)
    with torch.no_grad():
        assert (ref(x) - ours(x).logits).abs().max() <= 1e-5
        assert abs(float(ref(x, y)) - float(ours(x, y).loss)) <= 1e-5


@pytest.mark.parametrize("over", [dict(concept=dict(enabled=True)), dict(backbone="llama")])
def test_only_a_plain_neox_base_converts(over) -> None:
    with pytest.raises(ValueError, match="plain GPT-NeoX"):
        RefGPT.from_ncp(NCPModel(build_config("debug", max_seq_len=32, **over)))
