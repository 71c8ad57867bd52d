"""``activation_memory`` (ncpctl.model.accounting.memory) against what autograd really saves: the
unique storages (not parameters) that ``saved_tensors_hooks`` sees in a training forward of the
debug models, per activation-checkpointing mode. An estimator wrong by a sub-layer's internals
(or by a factor) fails."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.accounting.flops import at_realised_ratio
from ncpctl.model.accounting.memory import activation_memory
from ncpctl.model.core.config import build_config
from ncpctl.model.core.model import NCPModel
from ncpctl.recipe import load_recipe
from ncpctl.train.recompute import apply_activation_checkpointing

from ..conftest import RECIPES

MODES = ("none", "selective", "full")


def saved_bytes(model: NCPModel, idx: torch.Tensor, mode: str) -> int:
    """Bytes of the distinct storages saved for the backward of one training forward (the
    checkpoints' own saved inputs included, their recomputed internals not: they exist only during
    the backward)."""
    apply_activation_checkpointing(model, mode)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(idx, idx)
    out.loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("size,dtype,tol", [("debug", "fp32", 0.05), ("llama-debug", "fp32", 0.06),
                                             ("llama-debug", "bf16", 0.08)])
def test_estimate_matches_the_saved_tensors_per_mode(size: str, dtype: str, tol: float) -> None:
    """neox (LayerNorm, GELU, parallel residual, partial rotary) and llama (RMSNorm in fp32,
    SwiGLU, GQA, QK-norm, sliding windows) ConceptLMs: the estimate is within ``tol`` of the
    measurement in each mode, and the modes' ordering and ratios are the measured ones."""
    T, B = 64, 2
    cfg = build_config(size, max_seq_len=T, concept=dict(enabled=True))
    torch.manual_seed(0)
    model = NCPModel(cfg).train()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    idx = torch.randint(0, 100, (B, T))
    est = activation_memory(cfg, T, B, dtype)
    got = {m: saved_bytes(model, idx, m) for m in MODES}
    for m in MODES:
        assert abs(est.saved(m) - got[m]) <= tol * got[m], (m, est.saved(m), got[m])
    assert got["none"] > got["selective"] > got["full"]
    assert est.recompute_peak["none"] == 0 < est.recompute_peak["selective"] < est.recompute_peak["full"]


@pytest.mark.parametrize("recipe", ["debug-archpreview.yaml", "debug-dlcm.yaml"])
def test_design_extras_are_approximately_counted(recipe: str) -> None:
    """NCP-ArchPreview (post-norm, QK-norm, IRC, three CRC connections, MTP) and DLCM (dynamic
    segmentation, a wider concept stack, the cross-attention coupling): within 15% per mode, the
    dynamic segmentation counted at the concepts the batch really has (its padded M)."""
    T, B = 64, 2
    cfg = load_recipe(RECIPES / recipe, [f"model.max_seq_len={T}", f"train.seq_len={T}"]).model_config
    torch.manual_seed(0)
    model = NCPModel(cfg).train()
    idx = torch.randint(0, 100, (B, T))
    got = {m: saved_bytes(model, idx, m) for m in MODES}
    ratio = None
    if cfg.law.variable_length:
        with torch.no_grad():
            M = model(idx, idx).concept.pred.shape[1]
        ratio = T / (M + 0.25)
        assert at_realised_ratio(cfg, ratio).expected_concepts(T) == M  # the concepts the stack ran on
    est = activation_memory(cfg, T, B, "fp32", realised_ratio=ratio)
    for m in MODES:
        assert abs(est.saved(m) - got[m]) <= 0.15 * got[m], (m, est.saved(m), got[m])


def test_math_attention_adds_the_scores_and_the_head_scales_with_the_vocabulary() -> None:
    """The math kernel keeps (B, H, T, T) scores and probabilities in every token layer that
    ``none`` keeps; the fused head's (N, V) logits buffer is N * V * bytes."""
    cfg = build_config("debug", max_seq_len=512)
    flash, math = (activation_memory(cfg, 512, 1, "bf16", k) for k in ("flash", "math"))
    L, H = cfg.n_token_layers, cfg.n_heads
    assert math.saved("none") - flash.saved("none") == L * 2 * 2 * H * 512 * 512
    assert math.saved("full") == flash.saved("full")
    assert flash.kept["none"]["head"] >= 512 * cfg.padded_vocab_size * 2
    with pytest.raises(ValueError, match="attention"):
        activation_memory(cfg, 512, 1, "bf16", "sdpa")


def test_profile_accounting_reports_it_per_mode_in_the_recipe_precision() -> None:
    """``profile-kernels --only accounting`` (ncpctl.profile.accounting) carries the estimate of each
    variant per mode, and ``full`` < ``selective`` < ``none`` at a size where activations matter."""
    from ncpctl.profile.accounting import accounting_section

    cfg = build_config("debug", max_seq_len=1024, concept=dict(enabled=True))
    a = accounting_section(cfg, 1024, 2, 8, params=False, precision="bf16")
    got = a["variants"]["recipe"]["activation_memory"]
    want = activation_memory(cfg, 1024, 2, "bf16")
    assert got["dtype"] == "bf16" and got["total"] == {m: want.total(m) for m in MODES}
    assert got["total"]["full"] < got["total"]["selective"] < got["total"]["none"]
    assert a["variants"]["pm"]["activation_memory"]["kept"]["none"]["token_layers"] > \
        a["variants"]["base"]["activation_memory"]["kept"]["none"]["token_layers"]
