"""The performance rewrites of issue 6 against their references: the lean cross-entropy of
``NCPModel`` vs ``F.cross_entropy`` (value and gradient, ignored targets, bf16) and the
sign-folded rotary embedding vs HF's ``rotate_half`` form (bit-identical)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.config import build_config
from ncpctl.model.layers import apply_rope, rope
from ncpctl.model.model import NCPModel, cross_entropy


def _hf_rope(x, cos, sin):  # HF apply_rotary_pos_emb on the first rotary dims
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, xp), dim=-1)


@pytest.mark.parametrize("size", ["debug", "llama-debug"])  # 25% and 100% rotary dims
def test_rope_is_bit_identical_to_rotate_half(size: str) -> None:
    cfg = build_config(size)
    x = torch.randn(2, 7, cfg.n_heads, cfg.head_dim).transpose(1, 2).requires_grad_()  # (B, H, T, hd), strided
    cos, sin = rope(torch.arange(7)[None] + 3, cfg, x.dtype)
    ours, ref = apply_rope(x, cos, sin), _hf_rope(x, cos, sin)
    assert torch.equal(ours, ref)
    g = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(ref, x, g)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (3 * torch.randn(3, 45, 300)).to(dtype).requires_grad_()  # 135 rows: several row blocks
    y = torch.randint(0, 300, (3, 45))
    y[0, :7] = -100
    ours = cross_entropy(x, y)
    ref = F.cross_entropy(x.float().flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    g_ours, = torch.autograd.grad(2.5 * ours, x)
    g_ref, = torch.autograd.grad(2.5 * ref, x)
    assert g_ours.dtype == dtype
    torch.testing.assert_close(g_ours.float(), g_ref.float(), rtol=1e-5, atol=1e-6)
    assert (g_ours[0, :7] == 0).all()  # ignored positions get no gradient


def test_cross_entropy_all_ignored_is_nan_like_reference() -> None:
    x = torch.randn(4, 10, requires_grad=True)
    y = torch.full((4,), -100)
    assert torch.isnan(cross_entropy(x, y)) and torch.isnan(F.cross_entropy(x, y))


def test_model_loss_and_grads_match_reference_loss() -> None:
    cfg = build_config("debug", concept=dict(enabled=True))
    torch.manual_seed(0)
    model = NCPModel(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    y = torch.randint(0, cfg.vocab_size, (2, 33))
    out = model(x, y)
    ref = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
    torch.testing.assert_close(out.ntp_loss, ref, rtol=1e-6, atol=1e-6)
    g_ours = torch.autograd.grad(out.ntp_loss, model.lm_head.weight, retain_graph=True)[0]
    g_ref = torch.autograd.grad(ref, model.lm_head.weight)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
