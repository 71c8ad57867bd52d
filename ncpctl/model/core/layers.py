"""The one transformer block type (spec section 4), shared by the token and concept stacks.

``neox`` (GPT-NeoX/Pythia), ``llama`` (Llama/OLMo/Qwen3-style) and ``gpt2`` are configurations
of the same ``Block``: the backbone family (family.py) chooses the norm and the MLP when the
block is built; norm placement (pre, or OLMo-2/3's post), residual layout, rotary fraction,
GQA, QK-norm and the per-layer sliding window come from ``ModelConfig``. With matching
weights a stack of these blocks is numerically the HF reference
(tests/model/test_hf.py).

Layout choices (the HF converters in ``hf.py`` translate):
* ``attn.qkv`` is one fused Linear whose rows are ``[q (H*hd); k (Hkv*hd); v (Hkv*hd)]``
  (HF GPT-NeoX interleaves q/k/v per head; HF Llama has three Linears).
* ``mlp.fc`` is ``Linear(d, ffn)`` (neox, gpt2: GELU) or ``Linear(d, 2*ffn)`` = ``[gate; up]``
  (llama, SwiGLU); ``mlp.proj`` maps back to d (a family's own MLP names its output ``proj`` too).

A ``Block`` returns its *update* R (what a plain residual network adds to its input); a
``Stack`` of blocks combines the updates through a depth mixer, its ``residual``
(``PlainResidual``: x + R; extension point ``model.residual``). The stack reads everything
about the call (RoPE tables, masks per window, KV caches, a memory to cross-attend to,
per-layer additions, cross-module sources) from one ``Context``, and can return the state after
every depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ncpctl.model.core.config import ModelConfig, strategy
from ncpctl.model.core.rope import apply_rope, inv_freq, rope  # noqa: F401  (re-exported: the blocks' RoPE)
from ncpctl.model.registry import family
from ncpctl.model.core.patterns import (Pattern, as_pattern, attn_mask, dense_mask, document_masks,  # noqa: F401  (attn_mask: re-exported)
                       document_positions, is_block_mask, kernel_masks)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as HF ``LlamaRMSNorm`` (bit-for-bit in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm of ``cfg``'s backbone family (family.py), e.g. LayerNorm (neox, gpt2), RMSNorm (llama)."""
    return family(cfg.backbone).norm(cfg, dim)


# ---- rotary position embedding ---------------------------------------------------------


# ---- attention masks (patterns.py) and KV cache ----------------------------------------


def causal_masks(windows: set, T: int, device: torch.device) -> dict:
    """Masks for a plain (unpadded, uncached) sequence of length T, one per window (a causal
    pattern's key): ``None`` means SDPA ``is_causal=True``; an explicit mask is built only for a
    window shorter than the sequence (``kernel_masks`` of patterns.py, for any declared pattern)."""
    return kernel_masks(windows, T, device)


class KVCache:
    """Keys/values of one attention layer: (B, Hkv, capacity, hd) each.

    The caller sets ``at`` before a forward: an int writes the new T positions at
    ``at:at+T`` for every row; a LongTensor (B,) writes each row's T new positions from its own
    index. ``len`` is how many positions attention then reads. With ``capacity``
    the buffers are allocated once; without (HF ``generate`` does not say how many tokens
    will come) they are allocated on first write and double when ``len`` outgrows them.
    """

    def __init__(self, batch: int, n_kv: int, head_dim: int, device, dtype, capacity: int | None = None):
        self.shape, self.device, self.dtype = (batch, n_kv, head_dim), device, dtype
        self.k = self.v = None
        if capacity is not None:
            self._grow(capacity)
        self.at: int | torch.Tensor = 0
        self.len = 0

    def _grow(self, capacity: int) -> None:
        B, H, hd = self.shape
        k = torch.zeros(B, H, capacity, hd, device=self.device, dtype=self.dtype)
        v = torch.zeros_like(k)
        if self.k is not None:
            n = self.k.shape[2]
            k[:, :, :n], v[:, :, :n] = self.k, self.v
        self.k, self.v = k, v

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.len > self.capacity:
            self._grow(max(self.len, 2 * self.capacity))
        if isinstance(self.at, int):
            self.k[:, :, self.at : self.at + k.shape[2]] = k
            self.v[:, :, self.at : self.at + v.shape[2]] = v
        elif k.shape[2] == 1:
            rows = torch.arange(k.shape[0], device=k.device)
            self.k[rows, :, self.at] = k[:, :, 0]
            self.v[rows, :, self.at] = v[:, :, 0]
        else:  # T positions per row from its own index (speculative decoding's ragged rows)
            at = self.at[:, None] + torch.arange(k.shape[2], device=k.device)  # (B, T)
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[rows, :, at] = k.transpose(1, 2)  # indexed view (B, T, H, hd)
            self.v[rows, :, at] = v.transpose(1, 2)
        return self.k[:, :, : self.len], self.v[:, :, : self.len]

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (B,) in that order (beam search)."""
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]

    def rows(self, rows: torch.Tensor) -> "RowsCache":
        """This cache seen through batch rows ``rows`` (R,) only: a forward over those R rows
        writes into and reads from their rows here (a decoding step that only some rows need)."""
        return RowsCache(self, rows)


class RowsCache:
    """``KVCache.rows``: the same ``at`` (an (R,) per-row index or an int) / ``len`` / ``update``
    contract over a subset of the batch rows. Reads gather (R, Hkv, len, hd) copies."""

    def __init__(self, cache: KVCache, rows: torch.Tensor):
        self.cache, self.idx = cache, rows
        self.at: int | torch.Tensor = 0
        self.len = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        if self.len > c.capacity:
            c._grow(max(self.len, 2 * c.capacity))
        if isinstance(self.at, int):
            at = torch.arange(self.at, self.at + k.shape[2], device=k.device)
            c.k[self.idx[:, None], :, at[None]] = k.transpose(1, 2)
            c.v[self.idx[:, None], :, at[None]] = v.transpose(1, 2)
        else:
            c.k[self.idx, :, self.at] = k[:, :, 0]
            c.v[self.idx, :, self.at] = v[:, :, 0]
        return c.k[self.idx, :, : self.len], c.v[self.idx, :, : self.len]


@dataclass
class Context:
    """Everything a stack needs besides its input x (B, T, d).

    ``cos``/``sin`` (B|1, 1, T, rotary_dim) from ``rope``; ``masks`` maps each layer's attention
    pattern (its ``Pattern.key``: a causal pattern's window) to its SDPA mask (B|1, 1, T, Tk) or None
    (``is_causal``); ``caches`` one ``KVCache`` per layer
    (incremental decoding) with the write index ``at`` and read length ``length``; ``memory``
    (B, M, d_mem) and ``memory_mask`` (B|1, 1, T, M) for blocks that cross-attend (a coupling
    that attends to concepts sets them); ``adds`` maps a layer index to a tensor added to the
    residual stream after that layer (interventions), broadcasting against (B, T, d); ``post``,
    if set, is called as ``x = post(-1, x)`` on the stack input and ``x = post(i, x)`` after each
    layer's residual (cross-module residuals); ``sources``, if set, are states of earlier modules
    aligned to this stack's sequence, each (B, T, d), handed to a depth mixer that reads them
    (``Residual.reads_sources``: Block AttnRes's cross-module connections).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict
    caches: list | None = None
    at: int | torch.Tensor = 0
    length: int = 0
    memory: torch.Tensor | None = None
    memory_mask: torch.Tensor | None = None
    adds: dict[int, torch.Tensor] = field(default_factory=dict)
    post: Any = None
    sources: list | None = None

    @classmethod
    def causal(cls, cfg: ModelConfig, positions: torch.Tensor, patterns, dtype: torch.dtype,
               limit: int | None = None) -> "Context":
        """A plain (unpadded, uncached) sequence with integer RoPE ``positions`` (B|1, T), all below
        ``limit`` (default: T), for layers of the given attention ``patterns`` (``Pattern``s, or
        bare windows: causal ones), each mapped to its fastest kernel (``kernel_masks``)."""
        cos, sin = rope(positions, cfg, dtype, limit=limit or positions.shape[-1])
        return cls(cos, sin, kernel_masks(set(patterns), positions.shape[-1], positions.device))

    @classmethod
    def documents(cls, cfg: ModelConfig, doc: torch.Tensor, patterns, dtype: torch.dtype) -> tuple["Context", torch.Tensor]:
        """A packed (unpadded, uncached) batch of documents ``doc`` (B, T) (each position's document
        index): positions restart at 0 per document, and every pattern is also block-diagonal by
        document (patterns.document_masks). Returns (context, positions (B, T))."""
        positions = document_positions(doc)
        cos, sin = rope(positions, cfg, dtype, limit=doc.shape[-1])
        return cls(cos, sin, document_masks(set(patterns), doc)), positions

    def with_(self, **changes: Any) -> "Context":
        return replace(self, **changes)


# ---- the block -------------------------------------------------------------------------


class Attention(nn.Module):
    # stability diagnostics (stability.py): while set, called as probe(q, k, mask) with exactly
    # what SDPA gets; None (the class default) in every other forward, which then does nothing extra
    probe: Any = None

    def __init__(self, cfg: ModelConfig, window: int | None | Pattern):
        """``window``: the layer's declared attention pattern (patterns.py), or a bare sliding
        window (None: full), i.e. ``Causal(window)``. The context hands the layer the mask the
        pattern maps to (``Context.masks[pattern.key]``): None = SDPA ``is_causal``."""
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.pattern = as_pattern(window)
        self.window, self.mask_key = self.pattern.window, self.pattern.key
        self.qk_norm, self.clip = cfg.qk_norm, cfg.clip_qkv
        self.rotary = cfg.rotary_dim > 0  # gpt2: learned absolute positions, nothing to rotate
        q_dim, kv_dim = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(q_dim, cfg.d_model, bias=cfg.bias)
        # the logical matrices stacked in a fused Linear, as row counts: per-matrix Muon orthogonalises each alone
        self.fused_rows = {"qkv": (q_dim, kv_dim, kv_dim)}
        if cfg.qk_norm == "layer":  # OLMo-2 style: over the whole projection
            self.q_norm, self.k_norm = RMSNorm(q_dim, cfg.norm_eps), RMSNorm(kv_dim, cfg.norm_eps)
        elif cfg.qk_norm == "head":  # Qwen3 style: per head
            self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.norm_eps), RMSNorm(self.hd, cfg.norm_eps)

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv, self.hd
        qkv = self.qkv(x)  # (B, T, (H + 2 Hkv) hd)
        if self.clip is not None:  # OLMo-1 / Steerling: clamp the projection before QK-norm and RoPE
            qkv = qkv.clamp(-self.clip, self.clip)
        if self.rotary and self.qk_norm == "none":  # q and k are adjacent in qkv: rotate both in one pass
            qk, v = qkv.split([(H + Hkv) * hd, Hkv * hd], dim=-1)
            qk = apply_rope(qk.view(B, T, H + Hkv, hd), cos.transpose(1, 2), sin.transpose(1, 2))
            q, k = qk.split([H, Hkv], dim=2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H|Hkv, T, hd)
        else:
            q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
            if self.qk_norm == "layer":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.view(B, T, H, hd), k.view(B, T, Hkv, hd)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H|Hkv, T, hd)
            if self.rotary:  # gpt2 has none: its positions were added to the embeddings
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, len, hd)
        if is_block_mask(mask):  # a FlexAttention BlockMask (patterns.kernel_masks, on a GPU): uncached, T x T
            y = None if self.probe is not None else flex_attention(q, k, v, mask, self.n_kv != self.n_heads)
            if y is not None:
                return self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))
            mask = dense_mask(mask.mask_mod, B, T, q.device)  # the probe, or FlexAttention failed: the boolean mask
        if self.probe is not None:
            self.probe(q, k, mask)
        backends = cached_backends(q, cache is not None)
        if backends is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        else:
            with sdpa_kernel(backends):
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
                )
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


# SDPA backends for cached calls on a GPU: every one but cuDNN's. cuDNN's fused attention (which
# PyTorch prefers on Hopper) builds an execution plan per shape, and a decode step's key length
# grows by one each call, so every step re-planned: the first H200 run (torch 2.11) spent ~5 ms of
# host time per layer in _cudnn_attention_forward, 75 ms per token for pythia-160m at batch 1
# against 0.7 ms of kernels (bench/gpu_check.py --profile). Uncached calls (training, full
# forwards) have fixed shapes and keep cuDNN.
CACHED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cached_backends(q: torch.Tensor, cached: bool) -> list | None:
    """The SDPA backends a call may use: ``CACHED_BACKENDS`` for a cached call on a GPU, else
    ``None`` (PyTorch's own choice)."""
    return CACHED_BACKENDS if cached and q.is_cuda else None


_FLEX: dict = {}  # device type -> flex_attention (compiled on a GPU)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, gqa: bool) -> torch.Tensor | None:
    """FlexAttention (B, H, T, hd) with a ``BlockMask``, compiled once on a GPU (uncompiled it
    runs a reference implementation, not a fused kernel). None when it cannot run here (no
    Triton, an unsupported GPU): then FlexAttention is switched off for the process with one
    warning saying why (``patterns.disable_flex``) and the caller uses the boolean mask."""
    from ncpctl.model.core.patterns import disable_flex
    try:
        fn = _FLEX.get(q.device.type)
        if fn is None:
            from torch.nn.attention.flex_attention import flex_attention as flex

            fn = _FLEX[q.device.type] = torch.compile(flex, dynamic=False) if q.is_cuda else flex
        return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    except Exception as e:  # compile or kernel failure: fall back, never fail a training run on it
        disable_flex(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return None


class MLP(nn.Module):
    """The built-in families' MLP: GELU (``approximate``: none = exact, HF "gelu" (neox); tanh = HF
    "gelu_new" (gpt2)) or, ``gated``, SwiGLU with ``fc`` = [gate; up] (llama). The family chooses."""

    def __init__(self, cfg: ModelConfig, gated: bool = False, approximate: str = "none"):
        super().__init__()
        self.gated, self.approximate = gated, approximate
        self.fc = nn.Linear(cfg.d_model, (2 if self.gated else 1) * cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.fused_rows = {"fc": (cfg.ffn_dim, cfg.ffn_dim)} if self.gated else {}  # [gate; up]

    def forward(self, x):
        if self.gated:  # SwiGLU
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    """A block returning its update R, so that the stack's residual makes x + R.

    ``norm_placement: pre`` puts each norm on its sub-layer's input, s(x) = f(n(x)):
    parallel (neox) ``R = mlp(n2(x)) + attn(n1(x))`` (with x added last this is HF GPT-NeoX's
    summation order, bit for bit), or sequential ``R = a + mlp(n2(x + a))``, a = attn(n1(x)).
    ``post`` (OLMo-2/3) puts it on the output, s(x) = n(f(x)), with the same layouts:
    sequential ``R = a + n2(mlp(x + a))``, a = n1(attn(x)) (HF OLMo's h = x + a, h + n2(mlp(h))),
    parallel ``R = n2(mlp(x)) + n1(attn(x))``. The norms keep their names either way
    (``attn_norm`` = n1, ``mlp_norm`` = n2), so both placements have the same state-dict keys.

    ``cross``: an optional sub-layer ``cross(x', ctx)`` (a coupling's cross-attention to the
    concepts, reading ``ctx.memory``; x' its input normed by ``cross_norm``, or raw with the
    norm on its output under ``post``), run after attention: sequential ``x + a + c`` feeds the
    MLP; parallel adds ``c`` = s(x) to the update."""

    def __init__(self, cfg: ModelConfig, window: int | None = None, cross: nn.Module | None = None):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.post = cfg.norm_placement == "post"
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, window)
        if cross is not None:
            self.cross_norm, self.cross = make_norm(cfg, cfg.d_model), cross
        else:
            self.cross = None
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = family(cfg.backbone).mlp(cfg)

    def _sub(self, norm: nn.Module, f: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """One sub-layer's output: f(norm(x)) (pre-norm) or norm(f(x)) (post-norm)."""
        return norm(f(x, *args)) if self.post else f(norm(x), *args)

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        a = self._sub(self.attn_norm, self.attn, x, ctx.cos, ctx.sin, ctx.masks[self.attn.mask_key], cache)
        if self.cross is not None:
            return self._with_cross(x, a, ctx)
        if self.parallel:
            return self._sub(self.mlp_norm, self.mlp, x) + a
        return a + self._sub(self.mlp_norm, self.mlp, x + a)

    def _with_cross(self, x: torch.Tensor, a: torch.Tensor, ctx: Context) -> torch.Tensor:
        if self.parallel:
            return self._sub(self.mlp_norm, self.mlp, x) + a + self._sub(self.cross_norm, self.cross, x, ctx)
        ac = a + self._sub(self.cross_norm, self.cross, x + a, ctx)
        return ac + self._sub(self.mlp_norm, self.mlp, x + ac)


class Residual(nn.Module):
    """A depth mixer: how a stack turns layer l's input x and update R into layer l+1's input.

    ``begin(x0)`` is called with the stack's input and returns the mixer's running state (for
    mixers over all earlier depths, e.g. NCP-ArchPreview's IRC or DenseFormer); ``forward(l, x,
    update, state)`` returns the next input. Mixers must be position-wise (no mixing across
    tokens), so causality and cached decoding hold for any of them; a mixer whose init is part
    of the design sets ``owns_init = True`` and initialises itself in ``reset_parameters``
    (``NCPModel.init_weights`` leaves it alone). Mixer parameters get no weight decay.

    ``first_input(x0, state)`` is layer 0's input (x0 unless the mixer reads cross-module
    sources: ``reads_sources`` mixers get ``begin(x0, sources)``); ``depths(state, seen)`` the
    ``n_depths`` states a later module reads (default ``seen``: the input and every layer's output).
    """

    owns_init = False
    no_weight_decay = True  # mixing coefficients are not decayed (the optimizer reads this)
    reads_sources = False

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__()
        self.n_depths = n_layers + 1

    def begin(self, x0: torch.Tensor) -> Any:
        return None

    def first_input(self, x0: torch.Tensor, state: Any) -> torch.Tensor:
        return x0

    def depths(self, state: Any, seen: list) -> list:
        return seen

    def forward(self, layer: int, x: torch.Tensor, update: torch.Tensor, state: Any) -> torch.Tensor:
        raise NotImplementedError


class PlainResidual(Residual):
    """x + R: the standard residual network (no parameters)."""

    def forward(self, layer, x, update, state):
        return update + x


class Stack(nn.Module):
    """Layers run in order with a depth mixer between them.

    The blocks are the children ``"0"``, ``"1"``, ... (the state-dict keys of a ModuleList, so
    checkpoints are unchanged); ``stack[i]``, ``len(stack)`` and iteration see blocks only.
    """

    def __init__(self, cfg: ModelConfig, windows, residual: str | None = None, cross=None):
        """``cross(i)``: an optional factory of block i's cross sub-layer (a coupling's)."""
        super().__init__()
        self.n = len(windows)
        fam = family(cfg.backbone)  # the family builds the blocks (Block unless it says otherwise)
        for i, w in enumerate(windows):
            self.add_module(str(i), fam.block(cfg, w, cross(i) if cross is not None else None))
        cls = strategy("residual", residual or cfg.residual)
        if not (isinstance(cls, type) and issubclass(cls, Residual)):
            raise TypeError(f"residual {residual or cfg.residual!r}: {cls!r} is not a Residual subclass")
        self.residual = cls(cfg, self.n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Block:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return getattr(self, str(i % self.n))

    def __iter__(self):
        return (getattr(self, str(i)) for i in range(self.n))

    @property
    def windows(self) -> set:
        return {blk.attn.window for blk in self}

    @property
    def patterns(self) -> set:
        """The layers' declared attention patterns (patterns.py)."""
        return {blk.attn.pattern for blk in self}

    @property
    def n_depths(self) -> int:
        """How many states ``forward(states=True)`` returns (the depths a later module reads)."""
        return self.residual.n_depths

    def _begin(self, x: torch.Tensor, ctx: Context):
        if ctx.post is not None:  # a connection into the stack's input (crc_mode: input)
            x = ctx.post(-1, x)
        if ctx.sources is None:
            return x, self.residual.begin(x)
        if not self.residual.reads_sources:
            raise TypeError(f"{type(self.residual).__name__} does not read cross-module sources")
        return x, self.residual.begin(x, ctx.sources)

    def forward(self, x: torch.Tensor, ctx: Context, states: bool = False):
        """x (B, T, d) -> the output (B, T, d); with ``states`` also the ``n_depths`` states a
        cross-module connection reads (the input and every layer's output, or the mixer's own)."""
        x, mix = self._begin(x, ctx)
        seen = [x] if states else None
        x = self.residual.first_input(x, mix)
        for i, blk in enumerate(self):
            cache = None
            if ctx.caches is not None:
                cache = ctx.caches[i]
                cache.at, cache.len = ctx.at, ctx.length
            x = self.residual(i, x, blk(x, ctx, cache), mix)
            if ctx.post is not None:
                x = ctx.post(i, x)
            if i in ctx.adds:
                x = x + ctx.adds[i]
            if states:
                seen.append(x)
        return (x, self.residual.depths(mix, seen)) if states else x
