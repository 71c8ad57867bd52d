"""Layer-level properties: the fused q/k rotary branch of ``Attention`` (taken when there is no
QK-norm) is bit-identical, forward and backward, to rotating q and k separately; a ``Stack``
keeps a ModuleList's state-dict names and returns its per-depth states; a post-norm ``Block``
returns the update of OLMo-2's formula (with and without a cross sub-layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.core.layers import Attention, Block, Context, Stack, apply_rope, causal_masks, rope

from ._helpers import tiny


def _separate(attn: Attention, x, cos, sin):
    """Attention with q and k rotated one after the other (the QK-norm branch without norms)."""
    B, T, _ = x.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv, attn.hd
    q, k, v = attn.qkv(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q, k = q.view(B, T, H, hd).transpose(1, 2), k.view(B, T, Hkv, hd).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = v.view(B, T, Hkv, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
    return attn.proj(y.transpose(1, 2).reshape(B, T, H * hd))


@pytest.mark.parametrize("backbone", ["neox", "llama"])
def test_fused_qk_rope_is_bit_identical(backbone):
    cfg = tiny(backbone)
    assert cfg.qk_norm == "none"
    torch.manual_seed(0)
    attn = Attention(cfg, None)
    x = torch.randn(2, 9, cfg.d_model, requires_grad=True)
    cos, sin = rope(torch.arange(9)[None], cfg, x.dtype)
    g = torch.randn(2, 9, cfg.d_model)
    fused = attn(x, cos, sin)
    sep = _separate(attn, x, cos, sin)
    assert torch.equal(fused, sep)
    wrt = (x, attn.qkv.weight, attn.qkv.weight if attn.qkv.bias is None else attn.qkv.bias)
    for a, b in zip(torch.autograd.grad(fused, wrt, g), torch.autograd.grad(sep, wrt, g)):
        assert torch.equal(a, b)


def test_stack_names_and_states():
    cfg = tiny("neox")
    stack = Stack(cfg, cfg.token_windows)
    assert len(stack) == 3 and stack[-1] is stack[2] and [b for b in stack] == [stack[0], stack[1], stack[2]]
    assert {k.split(".")[0] for k in stack.state_dict()} == {"0", "1", "2"}  # as a ModuleList's
    x = torch.randn(1, 5, 32)
    ctx = Context(*rope(torch.arange(5)[None], cfg, x.dtype), causal_masks({None}, 5, x.device))
    out, states = stack(x, ctx, states=True)
    assert len(states) == 4 and states[0] is x and torch.equal(states[-1], out)
    y = x
    for blk in stack:  # plain residual: x + R layer by layer
        y = blk(y, ctx) + y
        assert any(torch.equal(y, s) for s in states)


class _Cross(torch.nn.Module):
    """A stand-in cross sub-layer: a Linear of its input (the block passes ctx along)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, ctx):
        return self.lin(x)


@pytest.mark.parametrize("backbone", ["llama", "neox", "gpt2"])
@pytest.mark.parametrize("with_cross", [False, True])
def test_post_norm_block_update(backbone, with_cross):
    """post: every norm on its sub-layer's output. Sequential R = a + n_m(mlp(x + a)) with
    a = n_a(attn(x)) (a cross sub-layer c = n_c(cross(x + a)) sits between: R = a + c +
    n_m(mlp(x + a + c))); parallel R = n_m(mlp(x)) + a (+ n_c(cross(x)))."""
    cfg = tiny(backbone, norm_placement="post")
    torch.manual_seed(0)
    blk = Block(cfg, None, _Cross(cfg.d_model) if with_cross else None)
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norm gains away from 1: a misplaced norm shows
    x = torch.randn(2, 7, cfg.d_model)
    ctx = Context(*rope(torch.arange(7)[None], cfg, x.dtype), causal_masks({None}, 7, x.device))
    a = blk.attn_norm(blk.attn(x, ctx.cos, ctx.sin))
    if cfg.parallel_residual:
        want = blk.mlp_norm(blk.mlp(x)) + a
        if with_cross:
            want = want + blk.cross_norm(blk.cross(x, ctx))
    else:
        c = blk.cross_norm(blk.cross(x + a, ctx)) if with_cross else 0
        want = a + c + blk.mlp_norm(blk.mlp(x + a + c))
    got = blk(x, ctx)
    assert (got - want).abs().max() <= 1e-6
    pre = Block(tiny(backbone), None, _Cross(cfg.d_model) if with_cross else None)
    assert set(pre.state_dict()) == set(blk.state_dict())  # same names in both placements
    pre.load_state_dict(blk.state_dict())
    assert (pre(x, ctx) - got).abs().max() > 1e-2


@pytest.mark.parametrize("at", ["int", "per_row"])
def test_a_rows_view_of_a_kv_cache_writes_and_reads_those_rows_only(at):
    """``KVCache.rows``: a write through rows (2, 0) lands where writing those rows of the whole
    cache would, leaves row 1 alone, and reads back exactly those rows; a view past capacity
    grows the shared buffers."""
    from ncpctl.model.core.layers import KVCache

    torch.manual_seed(0)
    B, H, hd = 3, 2, 4
    cache = KVCache(B, H, hd, "cpu", torch.float64, capacity=4)
    cache.k.normal_(), cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    rows = torch.tensor([2, 0])
    view = cache.rows(rows)
    k, v = torch.randn(2, H, 1, hd, dtype=torch.float64), torch.randn(2, H, 1, hd, dtype=torch.float64)
    index = torch.tensor([5, 1])  # row 2 writes past the capacity of 4
    view.at, view.len = (int(index.max()) if at == "int" else index), 6
    got_k, got_v = view.update(k, v)
    assert cache.capacity >= 6
    want_k, want_v = torch.zeros(B, H, cache.capacity, hd, dtype=torch.float64), None
    want_k[:, :, :4] = before_k
    want_v = want_k.clone()
    want_v[:, :, :4] = before_v
    for r, (b, j) in enumerate(zip(rows.tolist(), index.tolist() if at == "per_row" else [5, 5])):
        want_k[b, :, j], want_v[b, :, j] = k[r, :, 0], v[r, :, 0]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    assert torch.equal(cache.k[1, :, :4], before_k[1])
    assert torch.equal(got_k, want_k[rows, :, :6]) and torch.equal(got_v, want_v[rows, :, :6])


@pytest.mark.parametrize("qk_norm", ["none", "head"])
def test_clip_qkv_clamps_the_fused_projection_before_qk_norm_and_rope(qk_norm):
    """Steerling-8B / OLMo-1: qkv = clamp(W x, -c, c), then QK-norm and RoPE."""
    clipped = tiny("llama", qk_norm=qk_norm, clip_qkv=0.3)
    plain = tiny("llama", qk_norm=qk_norm)
    torch.manual_seed(0)
    a = Attention(clipped, None)
    b = Attention(plain, None)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 7, clipped.d_model) * 4  # projections well beyond 0.3: the clamp bites
    cos, sin = rope(torch.arange(7)[None], clipped, x.dtype)
    assert a.qkv(x).abs().max() > 1.0
    b.qkv.register_forward_hook(lambda m, i, out: out.clamp(-0.3, 0.3))
    assert torch.equal(a(x, cos, sin), b(x, cos, sin))
    b2 = Attention(plain, None)
    b2.load_state_dict(a.state_dict())
    assert not torch.allclose(a(x, cos, sin), b2(x, cos, sin), atol=1e-3)


@pytest.mark.parametrize("bad", [0, -1.0, "10", True])
def test_clip_qkv_must_be_a_positive_number(bad):
    from ncpctl.model import ConfigError

    with pytest.raises(ConfigError, match="clip_qkv"):
        tiny("llama", clip_qkv=bad)
