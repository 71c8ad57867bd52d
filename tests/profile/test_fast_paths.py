"""The performance rewrites of issue 6 against their references: the fused LM head + loss of
``NCPModel`` vs ``F.cross_entropy`` (value and gradient, ignored targets, bf16, its kept
workspace) and the
sign-folded rotary embedding vs HF's ``rotate_half`` form (bit-identical)."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.core.config import build_config
from ncpctl.model.core.layers import apply_rope, rope
from ncpctl.model.core.head import LMHead, block_rows, cross_entropy
from ncpctl.model.core.model import NCPModel


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


def _reference(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [2.5, -1.5])  # backward of the fused head with either sign
def test_fused_head_matches_reference(dtype: torch.dtype, grad_scale: float) -> None:
    torch.manual_seed(0)
    head = LMHead(16, 300).to(dtype)
    h = torch.randn(135, 16, dtype=dtype, requires_grad=True)  # 135 rows: several row blocks
    y = torch.randint(0, 300, (135,))
    y[:7] = -100
    logits, ours = head(h, y)
    assert logits is None  # the logits' memory becomes their gradient
    ref = _reference(h, head.weight, y)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    g_ours = torch.autograd.grad(grad_scale * ours, [h, head.weight])
    g_ref = torch.autograd.grad(grad_scale * ref, [h, head.weight])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    for a, b in zip(g_ours, g_ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert (g_ours[0][:7] == 0).all()  # ignored positions get no gradient


def test_cross_entropy_value_matches_reference() -> None:
    x = 3 * torch.randn(3, 45, 300)
    y = torch.randint(0, 300, (3, 45))
    y[0, :7] = -100
    ref = F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(cross_entropy(x, y), ref, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # no graph: the head is a plain Linear and returns its logits
        head = LMHead(16, 300)
        hh = torch.randn(3, 45, 16)
        logits, loss = head(hh, y)
        torch.testing.assert_close(loss, _reference(hh.flatten(0, 1), head.weight, y.flatten()), rtol=1e-6, atol=1e-6)
        assert logits.shape == (3, 45, 300)


def test_loss_blocks_are_cache_sized_on_cpu_and_few_elsewhere() -> None:
    assert block_rows(torch.empty(2048, 50304)) == 32
    assert block_rows(torch.empty(16384, 50304, device="meta")) == 1334  # 13 blocks, not 512 launches


def test_cross_entropy_all_ignored_is_nan_like_reference() -> None:
    x = torch.randn(4, 10, requires_grad=True)
    y = torch.full((4,), -100)
    assert torch.isnan(cross_entropy(x, y)) and torch.isnan(F.cross_entropy(x, y))
    head = LMHead(10, 7)
    loss = head(x, y)[1]
    assert torch.isnan(loss)
    for g in torch.autograd.grad(loss, [x, head.weight]):  # zero gradients, as the reference's
        assert torch.equal(g, torch.zeros_like(g))


def test_fused_head_under_autocast_is_linear_under_autocast() -> None:
    torch.manual_seed(0)
    head = LMHead(16, 300)
    y = torch.randint(0, 300, (40,))
    for h in (torch.randn(40, 16, requires_grad=True), torch.randn(40, 16).bfloat16().requires_grad_()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = head(h, y)[1]
            ref = F.cross_entropy(F.linear(h, head.weight).float(), y)  # F.linear runs in bf16 here
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        g_ours = torch.autograd.grad(ours, [h, head.weight])
        g_ref = torch.autograd.grad(ref, [h, head.weight])
        assert g_ours[1].dtype == torch.float32  # the fp32 weight gets an fp32 gradient
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert head._workspace.dtype == torch.bfloat16  # the logits were bf16, as F.linear's


def test_head_workspace_is_reused_and_never_shared() -> None:
    torch.manual_seed(0)
    head = LMHead(8, 50)
    y = torch.randint(0, 50, (20,))
    hs = [torch.randn(20, 8, requires_grad=True) for _ in range(3)]
    refs = [torch.autograd.grad(_reference(h, head.weight, y), [h, head.weight]) for h in hs]

    def grads(loss, h):
        return torch.autograd.grad(loss, [h, head.weight])

    got0 = grads(head(hs[0], y)[1], hs[0])
    ws = head._workspace.data_ptr()
    got1 = grads(head(hs[1], y)[1], hs[1])
    assert head._workspace.data_ptr() == ws  # the next step reuses the kept buffer
    # two forwards before their backwards: the second must not write into the first's buffer
    l1, l2 = head(hs[1], y)[1], head(hs[2], y)[1]
    got2, got1b = grads(l2, hs[2]), grads(l1, hs[1])
    for got, ref in [(got0, refs[0]), (got1, refs[1]), (got2, refs[2]), (got1b, refs[1])]:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a graph dropped without backward frees the workspace for the next forward
    dropped = head(hs[0], y)[1]
    del dropped
    kept = head(hs[1], y)[1]
    assert head._holder() is not None and head._workspace.data_ptr() == ws
    # scratch, not state: moving the head drops it; copies and pickles come without it
    head.to(torch.float64).to(torch.float32)
    assert head._workspace is None
    head(hs[1], y)[1].backward()  # and a new one is taken
    assert head._workspace is not None
    for clone in (copy.deepcopy(head), pickle.loads(pickle.dumps(head))):
        assert clone._workspace is None and torch.equal(clone.weight, head.weight)
    # the backward overwrote what it saved: a second backward is refused, not wrong
    loss = kept * 1.0
    torch.autograd.grad(loss, hs[1], retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(loss, hs[1])


def test_model_loss_and_grads_match_reference_loss() -> None:
    cfg = build_config("debug", concept=dict(enabled=True))
    torch.manual_seed(0)
    model = NCPModel(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    y = torch.randint(0, cfg.vocab_size, (2, 33))
    out = model(x, y)
    assert out.logits is None
    ref = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
    torch.testing.assert_close(out.ntp_loss, ref, rtol=1e-6, atol=1e-6)
    g_ours = torch.autograd.grad(out.ntp_loss, model.lm_head.weight)[0]
    g_ref = torch.autograd.grad(ref, model.lm_head.weight)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: the same loss, and the logits
        ev = model(x, y)
    torch.testing.assert_close(ev.ntp_loss, out.ntp_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ev.logits, model(x).logits)


def test_liger_loss_is_optional_and_used_only_on_a_gpu(monkeypatch, request) -> None:
    """Liger Kernel's fused linear cross-entropy is an optional GPU speed-up (issue 45): absent or
    broken it is None; on the CPU the head's own loss runs even where it is installed; a GPU tensor
    gets it, unless ``USE_LIGER`` is off or the caller counts top-1 hits (which read the logits)."""
    import importlib.util
    from types import SimpleNamespace

    from ncpctl.model.core import head as head_mod
    real = head_mod.liger_loss
    request.addfinalizer(real.cache_clear)  # the cached answer of this process, not this test's fakes
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    head_mod.liger_loss.cache_clear()
    assert head_mod.liger_loss() is None  # not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)  # installed but broken
    head_mod.liger_loss.cache_clear()
    assert head_mod.liger_loss() is None
    calls = []

    def fake(h, w, t, **kw):
        calls.append(kw)
        return (h @ w.t()).float().logsumexp(-1).mean()

    monkeypatch.setattr(head_mod, "liger_loss", lambda: fake)
    gpu = SimpleNamespace(is_cuda=True)
    assert head_mod.external_loss(gpu) is fake and head_mod.external_loss(torch.zeros(1)) is None
    monkeypatch.setattr(head_mod, "USE_LIGER", False)
    assert head_mod.external_loss(gpu) is None
    monkeypatch.setattr(head_mod, "USE_LIGER", True)
    head = LMHead(16, 300)
    h = torch.randn(2, 5, 16, requires_grad=True)
    t = torch.randint(0, 300, (2, 5))
    ref = torch.nn.functional.cross_entropy(head(h).flatten(0, 1).float(), t.flatten())
    assert torch.allclose(head(h, t)[1], ref, atol=1e-6) and calls == []  # the CPU: ours
    monkeypatch.setattr(head_mod, "external_loss", lambda x: fake)  # as a GPU tensor would get it
    head(h, t)
    assert calls == [{"ignore_index": -100, "accum_dtype": torch.float32}]
    _, loss, hits = head(h, t, top1=True)
    assert len(calls) == 1 and torch.allclose(loss, ref, atol=1e-6)  # top-1 counting: ours
