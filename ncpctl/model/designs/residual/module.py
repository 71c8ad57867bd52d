"""NCP-ArchPreview's dynamic residuals (paper Sec. 2.6, Eqs. 14-20; ncp-model.md sections 7-8)
and Table 3's (Sec. 4.4) other arms: the input-level cross connection and Block AttnRes.

**IRC** (intra-module, ``model.residual: irc``), a depth mixer of every stack: after layer l
(1-based) the candidates are the stack input and every layer output so far,
``X = {H_1, H_1 + R_1, ..., H_l + R_l}``, and the next input is their per-token weighted sum
``H_{l+1} = sum_j w_{l,j} X_j`` with ``w_l = MLP_l(R_l)``, *not* normalised (negative weights
allowed; ``irc_normalize: softmax`` is Table 3's per-stage-softmax variant). The MLP's last layer
starts at zero and a constant one-hot on the newest candidate is added, so at init the stack is
exactly the plain residual network. The paper does not give the MLP's width: ``irc_hidden``.

**CRC** (cross-module, ``model.crc_connections``): for a target module s and a source module u,
after each target layer l, ``alpha = softmax(MLP(T_l))`` over the K source depths (the source
module's input and each of its layers' outputs), ``M = sum_j alpha_j LN(S_j)``, and
``T <- T + D_l * M`` with a per-dimension scale D (0 at init: the plain network; ``crc_init``
is the paper's small init). Connections, aligned to the target's sequence:

* ``encoder-concept``: encoder depths pooled to concepts by the segmentation (it must pool
  any width, as fixed blocks do: ``Segmenter.pools_any_width``);
* ``encoder-decoder``: token-aligned;
* ``concept-decoder``: concept depths spread to the tokens exactly as pred is (token t sees the
  concepts closed at or before it), so the model stays causal with CRC on.

``crc_mode: input`` is Table 3's "IRC + input-level cross connection" (Sec. 4.4). The reading
notes give the row only (2.2292, +0.024% FLOPs, the same extra FLOPs as IRC alone); we read
"input-level" as *where* the connection enters: each connection is applied once, on the target
module's input (the concept stack's pooled c, the decoder's z, before their first layer and so
before IRC sees them), with the same depth selection over the K source depths, LN and scale D
(0 at init: the plain network), instead of after every target layer. Its cost is one target
layer's CRC per connection (at Table 3's 1B: 0.088% of the forward FLOPs, IRC alone 0.077%).
The paper prints the same +0.024% for both rows, so its connection may be cheaper still; the
other reading, a single boundary state as the only source, would be (it is not implemented).

**Block AttnRes** (``residual: block_attnres``; Kimi Team, "Attention Residuals", arXiv
2603.15031; Table 3's external baseline, "block size 4, with cross-module connections"): the
stored values are the stack input ``b_0`` and, per block of ``attnres_block`` layers, the sum of
its layers' updates ``b_n = sum R_l`` (the current block's running sum ``p`` is a value too).
Layer l's input, and the stack's output after its last layer, is
``h = sum_i alpha_i v_i`` with ``alpha = softmax_i(w . RMSNorm(v_i))`` over those values, ``w`` a
learned pseudo-query per layer (zero at init: a uniform mean, as the paper initialises it) and a
per-layer RMSNorm on the keys. The paper mixes before every sub-layer (attention, MLP); ncpctl's
depth mixers sit between blocks, so here one mixing per transformer layer and ``attnres_block``
counts layers. Softmax weights sum to one, so Block AttnRes cannot start as the plain residual
(whose weights are all one): its tests compare with a direct reference of these formulas.

With ``attnres_cross`` the block states continue across the modules: the concept stack's
values start with the encoder's block states pooled by the segmentation (as CRC pools them), the
decoder's with the encoder's (token-aligned) and the concept stack's spread to the tokens exactly
as pred is (token t sees the states of the concepts closed at or before it; zeros before the
first). A stack's first layer then reads them too (its input is the softmax over all values).
A stack hands on its input, its block states and, last, its output (the encoder's h, which the
concepts are pooled from), so a later module reads 2 + ceil(n / attnres_block) states of it.

All mixers work per position, so cached decoding equals the full forward (decode.py keeps the
sources a new token needs). Their parameters get no weight decay (``no_weight_decay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.designs.residual.config import AttnResCost
from ncpctl.model.core.layers import Residual

CONNECTIONS = ("encoder-concept", "encoder-decoder", "concept-decoder")


def _weight_mlp(d: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, out))


class DepthMix(torch.autograd.Function):
    """out = sum_j w[..., j] * values[j]: a per-token weighted sum over n depths in one batched
    matmul, forward and backward, instead of n multiply-adds (each a kernel on a GPU, and about
    four more in the backward); the depth mixers' host overhead (issue "Fast where users train").

    ``apply(w, stacked, *values)``: w (B, T, n), stacked (B, T, n, d) = stack(values, -2), values
    n tensors (B, T, d). The gradient flows to ``stacked`` (one (B, T, n, d) tensor, so a mixer that
    grows its stack by concatenation accumulates one tensor per layer, not n); ``values`` are given
    only to be saved: they are alive anyway as the stack's candidates, whereas saving ``stacked``
    would keep an n-deep copy per layer (quadratic memory in depth). The backward re-stacks them.
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, stacked: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, *values)
        return (w.to(stacked.dtype).unsqueeze(-2) @ stacked).squeeze(-2)  # (B, T, 1, n) @ (B, T, n, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w, *values = ctx.saved_tensors
        g = grad.unsqueeze(-2)  # (B, T, 1, d)
        grad_w = grad_s = None
        if ctx.needs_input_grad[0]:
            grad_w = (g @ torch.stack(values, -2).transpose(-1, -2)).squeeze(-2).to(w.dtype)  # (B, T, n)
        if ctx.needs_input_grad[1]:  # an outer product, as a batched GEMM of inner size 1: the mix's
            # backward is twice its forward in GEMMs, as every layer's (ncpctl.model.accounting.flops)
            grad_s = w.to(grad.dtype).unsqueeze(-1) @ g  # (B, T, n, 1) @ (B, T, 1, d) -> (B, T, n, d)
        return (grad_w, grad_s, *(None for _ in values))


def mix_depths(w: torch.Tensor, values: list, stacked: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w[..., j] values[j] (``DepthMix``): w (B, T, n), values n of (B, T, d) -> (B, T, d);
    ``stacked`` their stack along dim -2 when the caller keeps one."""
    if stacked is None:
        stacked = torch.stack(values, -2)
    return DepthMix.apply(w, stacked, *values)


@dataclass
class IRCState:
    """A stack's IRC candidates: the stack input and every layer's plain output so far, each (B, T, d),
    and their stack (B, T, n, d), grown by one candidate per layer."""

    seen: list
    stacked: torch.Tensor | None = None


_ONE_HOTS: dict = {}  # (n, device, dtype) -> (0, ..., 0, 1)


def _newest(n: int, like: torch.Tensor) -> torch.Tensor:
    """The constant one-hot (n,) on the newest of n candidates, made once per (n, device, dtype): a
    step adds it without making it (not a buffer: a model built on the meta device and then loaded
    has no data for an unsaved one)."""
    key = (n, str(like.device), like.dtype)
    if key not in _ONE_HOTS:
        _ONE_HOTS[key] = F.one_hot(torch.tensor(n - 1, device=like.device), n).to(like.dtype)
    return _ONE_HOTS[key]


class IRC(Residual):
    owns_init = True
    compile_region = True  # train.compile compiles its forward (ncpctl.train.compiled)

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__(cfg, n_layers)
        self.softmax = cfg.irc_normalize == "softmax"
        # layer i (0-based) mixes i + 2 candidates: the stack input and the outputs of layers 0..i
        self.mlps = nn.ModuleList(_weight_mlp(cfg.d_model, cfg.irc_hidden, i + 2) for i in range(n_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for mlp in self.mlps:
            mlp[0].reset_parameters()
            nn.init.zeros_(mlp[2].weight)
            nn.init.zeros_(mlp[2].bias)

    def begin(self, x0: torch.Tensor) -> "IRCState":
        return IRCState([x0], x0.unsqueeze(-2))

    def forward(self, layer: int, x: torch.Tensor, update: torch.Tensor, st: "IRCState") -> torch.Tensor:
        # the candidates live in a record, not a bare list: ZeRO-3's module hooks rebuild list
        # arguments (deepspeed apply_to_tensors_only), so appending to one was lost under ZeRO-3
        new = update + x  # H_l + R_l: the plain output of this layer
        st.seen.append(new)
        st.stacked = torch.cat([st.stacked, new.unsqueeze(-2)], dim=-2)  # (B, T, layer + 2, d)
        w = self.mlps[layer](update)  # (B, T, layer + 2), zero at init
        if self.softmax:  # the constant one-hot on the newest candidate, then the per-stage softmax
            return mix_depths((w + _newest(layer + 2, w)).softmax(-1), st.seen, st.stacked)
        # w + one-hot(newest): the one-hot's share is the newest candidate itself
        return mix_depths(w, st.seen, st.stacked) + new


class CrossModule(nn.Module):
    """One CRC connection into a target stack of ``n_target`` layers from K source depths
    (``at_input``: one application, on the target's input: ``crc_mode: input``)."""

    no_weight_decay = True
    owns_init = True  # D = crc_init (0: the plain network); NCPModel.init_weights leaves it alone
    compile_region = True  # train.compile compiles its forward (ncpctl.train.compiled)

    def __init__(self, cfg: ModelConfig, n_target: int, K: int):
        super().__init__()
        d = cfg.d_model
        self.K, self.init = K, cfg.crc_init
        self.at_input = cfg.crc_mode == "input"
        n_target = 1 if self.at_input else n_target
        self.mlps = nn.ModuleList(_weight_mlp(d, cfg.crc_hidden, K) for _ in range(n_target))
        self.norms = nn.ModuleList(nn.LayerNorm(d, eps=cfg.norm_eps) for _ in range(K))
        self.scale = nn.Parameter(torch.empty(n_target, d))  # D, one per target layer
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for mlp in self.mlps:
            for m in mlp:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        for n in self.norms:
            n.reset_parameters()
        nn.init.constant_(self.scale, self.init)

    def sources(self, depths: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """LN(S_j) of each source depth (each aligned to the target: (B, T_target, d)) and their
        stack (B, T_target, K, d), made once for all target layers (``DepthMix``)."""
        normed = [norm(s) for norm, s in zip(self.norms, depths)]
        return normed, torch.stack(normed, -2)

    def forward(self, layer: int, x: torch.Tensor, normed: tuple[list[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        alpha = F.softmax(self.mlps[layer](x), dim=-1)  # (B, T, K)
        return torch.addcmul(x, self.scale[layer], mix_depths(alpha, *normed))


class CrossModules(nn.Module):
    """The model's CRC connections (``crc_connections``), each a ``CrossModule``."""

    no_weight_decay = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = cfg.concept
        sizes = {"encoder": cfg.encoder_layers, "concept": c.concept_layers, "decoder": cfg.decoder_layers}
        self.links = nn.ModuleDict({
            name.replace("-", "_"): CrossModule(cfg, sizes[name.split("-")[1]], sizes[name.split("-")[0]] + 1)
            for name in cfg.crc_connections
        })

    def has(self, name: str) -> bool:
        return name.replace("-", "_") in self.links

    def hook(self, targets: list[tuple[str, list[torch.Tensor]]]) -> "CrossHook | None":
        """A ``Context.post`` hook applying the connections ``targets`` = [(name, aligned source
        depths)] after each layer of their target stack (or on its input); None when there are none."""
        links = [(self.links[name.replace("-", "_")], depths) for name, depths in targets]
        return CrossHook([(link, link.sources(depths)) for link, depths in links]) if links else None

    def attach(self, ctx, targets: list[tuple[str, list[torch.Tensor]]]):
        """``ctx`` with the connections ``targets`` into its stack (its ``post`` hook)."""
        post = self.hook(targets)
        return ctx if post is None else ctx.with_(post=post)


class CrossHook:
    """``post(layer, x)`` of a target stack: every connection into it, with its normed sources.
    The stack calls it with layer -1 on its input (``crc_mode: input`` applies there only)."""

    def __init__(self, applied: list[tuple[CrossModule, tuple[list[torch.Tensor], torch.Tensor]]]):
        self.applied = applied

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        for link, normed in self.applied:
            if (layer < 0) == link.at_input:
                x = link(max(layer, 0), x, normed)
        return x


# ---- Block Attention Residuals ----------------------------------------------------------


def _rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight, in fp32 (as layers.RMSNorm)."""
    v = v.to(torch.promote_types(v.dtype, torch.float32))
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class AttnResState:
    """A stack's Block AttnRes values: ``done`` the cross-module sources, the stack input and the
    completed blocks (each (B, T, d)), with their weightless RMSNorms ``keys`` (fp32, computed once);
    ``partial`` the running sum of the open block's updates (None right after a boundary), and its key."""

    done: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    partial: torch.Tensor | None = None
    partial_key: torch.Tensor | None = None
    own: int = 0  # index in ``done`` of the stack input (the values before it are cross-module sources)


class BlockAttnRes(Residual):
    """Block AttnRes over a stack of n layers (see the module docstring): n + 1 pseudo-queries
    (layer 0's input, layers 1..n-1's, the output) and as many key RMSNorm weights."""

    owns_init = True
    reads_sources = True  # Stack passes Context.sources (cross-module block states) to begin
    compile_region = True  # train.compile compiles its forward (ncpctl.train.compiled)

    @classmethod
    def cross_modules(cls, cfg: ModelConfig) -> "BlockSources | None":
        """The model's cross-module connections this mixer brings (``NCPModel.crc``): the block
        states across modules with ``attnres_cross`` and the concept path."""
        return BlockSources() if cfg.attnres_cross and cfg.concept.enabled else None

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__(cfg, n_layers)
        self.block, self.eps = cfg.attnres_block, cfg.norm_eps
        self.query = nn.Parameter(torch.empty(n_layers + 1, cfg.d_model))
        self.key_weight = nn.Parameter(torch.empty(n_layers + 1, cfg.d_model))
        self.n_depths = AttnResCost.depths(cfg, n_layers)  # the input, the blocks, the output
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)  # the paper's init: uniform weights over the values
        nn.init.ones_(self.key_weight)

    def attend(self, i: int, st: AttnResState) -> torch.Tensor:
        """Query i over ``st``'s values: (B, T, d). Over a single value (the encoder's first input)
        the weight is exactly 1, but it is computed anyway: every parameter gets a gradient."""
        values, keys = st.done, st.keys
        if st.partial is not None:
            values, keys = [*values, st.partial], [*keys, st.partial_key]
        w = self.query[i] * self.key_weight[i]  # w . (g * RMSNorm(v)) = (w * g) . RMSNorm(v)
        logits = torch.stack(keys, -2) @ w.to(keys[0].dtype)  # (B, T, n, d) @ (d,) -> (B, T, n)
        return mix_depths(logits.softmax(-1).to(values[0].dtype), values)

    def begin(self, x0: torch.Tensor, sources: list | None = None) -> AttnResState:
        done = [*(sources or ()), x0]
        return AttnResState(done=done, keys=[_rms(v, self.eps) for v in done], own=len(done) - 1)

    def first_input(self, x0: torch.Tensor, st: AttnResState) -> torch.Tensor:
        return self.attend(0, st)

    def forward(self, layer: int, x: torch.Tensor, update: torch.Tensor, st: AttnResState) -> torch.Tensor:
        st.partial = update if st.partial is None else st.partial + update
        st.partial_key = _rms(st.partial, self.eps)
        out = self.attend(layer + 1, st)
        if (layer + 1) % self.block == 0:  # the block is complete: store it
            st.done.append(st.partial)
            st.keys.append(st.partial_key)
            st.partial = st.partial_key = None
        return out

    def depths(self, st: AttnResState, seen: list) -> list:
        """This stack's own states (what a later module reads): its input, its blocks and, last as
        for every mixer, its output (the encoder's is h, which the concepts are pooled from)."""
        own = st.done[st.own:]
        return [*own, *([] if st.partial is None else [st.partial]), seen[-1]]


class BlockSources(nn.Module):
    """Block AttnRes's cross-module connections (``attnres_cross``): no parameters; ``attach``
    hands a target stack the aligned block states of its sources (``Context.sources``)."""

    def has(self, name: str) -> bool:
        return name in CONNECTIONS

    def attach(self, ctx, targets: list[tuple[str, list[torch.Tensor]]]):
        sources = [s for _, depths in targets for s in depths]
        return ctx.with_(sources=sources) if sources else ctx
