"""Rotary position embeddings (RoPE): the cos/sin tables of a config's frequencies (HF's formula,
Llama-3.1's ``rope_scaling`` included) and the rotation applied to queries and keys, bit for bit
HF's ``rotate_half`` form, forward and backward."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ncpctl.model.core.config import ModelConfig


def rope(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype,
         limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B|1, 1, T, rotary_dim) for integer ``positions`` (B|1, T), all below
    ``limit`` (default ``max_seq_len``; decoding past it passes its own).

    The exact HF formula from the config, for any per-row positions (ragged decoding, concept
    positions scaled by k), unaffected by ``model.to(dtype)`` or meta-device construction. The
    values are rows of a table of positions 0..limit-1 (``_rope_table``), made once per frequency
    set, device and dtype, and gathered here: one gather per forward or decode step instead of the
    eleven kernels computing them costs (a step's host overhead). The table's entries are computed
    by the same elementwise ops, so they equal the per-call values bit for bit. Checking the
    positions against the table would be a sync per step on a GPU, so ``limit`` is the caller's
    promise (a position past the table is an index error).
    """
    limit = max(limit or 0, cfg.max_seq_len)
    table = _rope_table(cfg, limit, positions.device, dtype)  # (P, 2 rd): cos | sin
    cos, sin = F.embedding(positions, table).chunk(2, dim=-1)  # (B|1, T, rd) each
    return cos[:, None], sin[:, None]


_ROPE_TABLES: dict = {}  # (frequencies, device, dtype) -> (P, 2 rotary_dim)


def _rope_table(cfg: ModelConfig, limit: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos | sin of positions 0..P-1 (P >= limit, grown by doubling), (P, 2 rotary_dim)."""
    key = (cfg.rotary_dim, cfg.rope_base, repr(cfg.rope_scaling), str(device), dtype)
    table = _ROPE_TABLES.get(key)
    if table is None or table.shape[0] < limit:
        n = max(limit, 2 * (0 if table is None else table.shape[0]))
        freqs = torch.arange(n, device=device)[:, None].float() * inv_freq(cfg, device)  # (P, rd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, rd)
        table = _ROPE_TABLES[key] = torch.cat((emb.cos().to(dtype), emb.sin().to(dtype)), dim=-1)
    return table


def inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """(rotary_dim / 2,) RoPE frequencies, with ``rope_scaling`` applied as HF computes it.

    llama3 (Llama-3.1): wavelengths longer than original_max / low_freq_factor are divided by
    ``factor``, shorter than original_max / high_freq_factor kept, and those between
    interpolated smoothly (transformers ``_compute_llama3_parameters``)."""
    rd = cfg.rotary_dim
    f = 1.0 / (cfg.rope_base ** (torch.arange(0, rd, 2, dtype=torch.float, device=device) / rd))
    rs = cfg.rope_scaling
    if rs is None:
        return f
    factor, lo, hi, old = (rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings"))
    wavelen = 2 * math.pi / f
    scaled = torch.where(wavelen > old / lo, f / factor, f)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A new contiguous copy of x whose first rd = cos.shape[-1] dims of the last axis are
    ``[x1 * c1 + x2 * a, x2 * c2 + x1 * b]`` (x1, x2 the halves of those dims); the rest copied.

    Written with ``out=`` kernels into one preallocated tensor: no flipped copy, no ``cat``,
    and no zero-filled slice gradients when used in a backward."""
    rd, h = cos.shape[-1], cos.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rd < x.shape[-1]:
        out[..., rd:].copy_(x[..., rd:])
    o = out[..., :rd]
    torch.mul(x[..., :rd], cos, out=o)
    tmp = torch.empty(o.shape, dtype=x.dtype, device=x.device)
    torch.mul(x[..., h:rd], a, out=tmp[..., :h])
    torch.mul(x[..., :h], b, out=tmp[..., h:])
    o.add_(tmp)
    return out


class _Rope(torch.autograd.Function):
    """HF ``rotate_half`` rotary embedding: ``xr * cos + cat(-x2, x1) * sin`` on the first
    rotary dims, the rest passed through, bit for bit (same products, same sums), forward
    and backward. The backward is the inverse rotation ``[g1*c1 + g2*s2, g2*c2 - g1*s1]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = cos.shape[-1] // 2
        s1, s2 = sin[..., :h], sin[..., h:]
        ns1 = -s1  # tiny table: the sign is exact
        ctx.save_for_backward(cos, ns1, s2)
        return _rotate(x, cos, ns1, s2)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        cos, ns1, s2 = ctx.saved_tensors
        return _rotate(g, cos, s2, ns1), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x (HF rotate_half form), bit-identical
    to HF's ``apply_rotary_pos_emb``; returns a new contiguous tensor.

    x is (B, H, T, hd) with cos, sin (B|1, 1, T, rotary_dim) as from ``rope``, or any layout
    that broadcasts against the tables (e.g. (B, T, H, hd) with ``cos.transpose(1, 2)``).
    """
    # Two formulations of the same products and sums (bit-identical, forward and backward). Eager runs
    # ``_Rope``: out= kernels into one preallocated tensor and a hand-written backward that saves only
    # the (T, rotary_dim) tables, not x. Measured at one thread, its forward+backward takes ~13-35% less
    # time than the autograd formula below or a traceable autograd.Function of it (q (8, 4, 256, 16) of
    # debug, rotary_dim 4, and (2, 8, 256, 64), full rotary). Dynamo cannot trace out= kernels into views,
    # so a compiled graph (train.compile) takes the plain formula.
    if torch.compiler.is_compiling():
        rd, h = cos.shape[-1], cos.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:rd]
        rot = torch.cat([x1 * cos[..., :h] - x2 * sin[..., :h], x2 * cos[..., h:] + x1 * sin[..., h:]], -1)
        return torch.cat([rot, x[..., rd:]], -1) if rd < x.shape[-1] else rot
    return _Rope.apply(x, cos, sin)
