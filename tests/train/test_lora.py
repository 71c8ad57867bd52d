"""LoRA as a stage set-up (ncpctl.train.lora) and the trainable counts of NCP-ArchPreview Sec. 5.1:
adapt-vq with a learned codebook trains 17,301,504 parameters at 8.9B; LoRA at the rank whose
count is closest; full fine-tuning everything."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("peft")

from ncpctl.model.accounting.flops import count_parameters  # noqa: E402
from ncpctl.model.core.config import build_config  # noqa: E402
from ncpctl.model.core.model import NCPModel  # noqa: E402
from ncpctl.recipe.schema import LoraSection  # noqa: E402
from ncpctl.train.lora import apply_lora, merge_adapters, scalings  # noqa: E402
from ncpctl.train.stages import freeze_all_but_codebook  # noqa: E402

PAPER_VQ = 17_301_504  # Sec. 5.1: concept heads 16,777,216 + codebook 524,288
LORA_PER_RANK = 2_631_680  # 40 blocks x (qkv 4096+12288, attn.proj 4096+4096, mlp.fc 4096+22016, mlp.proj 11008+4096)


def _debug(seed: int = 0) -> NCPModel:
    torch.manual_seed(seed)
    return NCPModel(build_config("debug", concept=dict(enabled=True))).eval()


def test_lora_trains_only_adapters_and_starts_at_the_checkpoints_logits() -> None:
    model = _debug()
    x = torch.randint(0, 2048, (2, 24))
    before = model(x).logits
    apply_lora(model, LoraSection(rank=2))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # every block's four projections, in the token and the concept layers (4 + 2 blocks)
    assert len(trained) == 2 * 4 * 6
    assert torch.equal(model(x).logits, before)  # B starts at zero


def test_merged_weights_are_the_adapted_model() -> None:
    """The checkpoint's inference view: the plain model with W + (alpha/r) B A computes the
    adapted model's logits, under the plain model's names."""
    model = _debug()
    apply_lora(model, LoraSection(rank=3, alpha=5.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.2)
    x = torch.randint(0, 2048, (2, 24))
    adapted = model(x).logits
    scale = scalings(model)
    assert len(scale) == 24 and set(scale.values()) == {5.0 / 3}
    merged = merge_adapters(model.state_dict(), scale)
    plain = NCPModel(model.cfg).eval()
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x).logits, adapted, rtol=1e-5, atol=1e-5)


def test_paper_trainable_counts_at_8_9b() -> None:
    """ncp-archpreview-8.9b, codebook: learned (meta device): adapt-vq 17,301,504 exactly; LoRA on
    the four projections of all 40 blocks at rank 7 (the closest count a rank allows); full = all."""
    cfg = build_config("ncp-archpreview-8.9b", concept=dict(codebook="learned"))
    vq = count_parameters(cfg, freeze_all_but_codebook)
    assert (vq.components["concept_heads"], vq.components["codebook"]) == (16_777_216, 524_288)
    assert vq.trainable == PAPER_VQ
    rank = min(range(1, 33), key=lambda r: abs(r * LORA_PER_RANK - PAPER_VQ))
    lora = count_parameters(cfg, partial(apply_lora, spec=LoraSection(rank=rank)))
    assert rank == 7 and lora.trainable == 7 * LORA_PER_RANK == 18_421_760
    assert lora.total == vq.total + lora.trainable  # adapters are new weights; nothing else trains
    assert count_parameters(cfg).trainable == vq.total == 8_935_055_360
