"""The forward FLOPs of each part of an NCP model at its real shapes, per sequence (accounting.py
sums them into ``ExactFlops``; accounting_backward.py walks their backward): the token and concept
stacks, the depth mixers and cross connections, the concept-path strategies (asked of each design:
``design_cost``), the bottleneck and the MTP head. Pure arithmetic on the config."""

from __future__ import annotations

from typing import Any

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.designs.bottleneck.config import BottleneckCost
from ncpctl.model.designs.mtp.config import MtpCost
from ncpctl.model.registry import family
from ncpctl.model.registry import design_cost

def _keys_full(n: int, window: int | None) -> int:
    """Query-key pairs SDPA computes for ``n`` queries: every query x min(n, window) keys."""
    return n * (n if window is None else min(n, window))


def _keys_causal(n: int, window: int | None) -> int:
    """Query-key pairs actually attended under the causal (+ sliding window) mask.

    Query i (0-based) sees min(i+1, window) keys: n(n+1)/2 without a window.
    """
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _stack_flops(cfg: ModelConfig, windows, n: int) -> dict[str, int]:
    """Forward matmul FLOPs of a stack whose layers have attention ``windows`` (one per layer)
    on ``n`` positions (one sequence)."""
    n_layers = len(windows)
    d, hd = cfg.d_model, cfg.head_dim
    q_dim = cfg.n_heads * hd
    kv_dim = cfg.n_kv_heads * hd
    gate_mats = family(cfg.backbone).mlp_matrices  # SwiGLU: gate, up, down; GELU: up, down
    qkv = 2 * n * d * (q_dim + 2 * kv_dim)
    attn_out = 2 * n * q_dim * d
    mlp = 2 * n * d * cfg.ffn_dim * gate_mats
    full = causal = 0
    for w in windows:
        # scores Q K^T and values A V: 2 FLOPs x head_dim per pair per head, twice.
        full += 2 * 2 * q_dim * _keys_full(n, w)
        causal += 2 * 2 * q_dim * _keys_causal(n, w)
    return {
        "qkv": n_layers * qkv,
        "attn_out": n_layers * attn_out,
        "mlp": n_layers * mlp,
        "attention": full,
        "attention_causal": causal,
    }


STACKS = ("encoder", "concept", "decoder")


def _crc_key(cfg: ModelConfig) -> str:
    return "residual.crc_input" if cfg.crc_mode == "input" else "residual.crc"


# the model's slot of each concept-path strategy (its parameters' prefix in ``named_parameters``)
SLOTS = {"segmentation": "concept.segmenter.", "coupling": "concept.coupling."}


def _concept_costs(cfg: ModelConfig) -> list[tuple[str, Any]]:
    """(slot, cost model) of the segmentation and the coupling that report their own matmuls."""
    c = cfg.concept
    if not c.enabled:
        return []
    costs = [(SLOTS[kind], design_cost(kind, name)) for kind, name in
             (("segmentation", c.segmentation), ("coupling", c.coupling))]
    return [(slot, cost) for slot, cost in costs if cost is not None]


def _design_flops(cfg: ModelConfig, T: int, M: int) -> dict[str, tuple[int, int]]:
    """The segmentation's and the coupling's own work at M concepts, as each design reports it
    (``design_cost``; DLCM: its pooling GEMM, the boundary predictor's W_q, W_k, the
    cross-attention's projections, scores and weighted sum): key -> (forward, its non-GEMM part).
    Fixed blocks and the additive coupling have none."""
    out = {}
    for _, cost in _concept_costs(cfg):
        vec = cost.vector(cfg, T, M) if hasattr(cost, "vector") else {}
        out.update({k: (f, vec.get(k, 0)) for k, f in cost.flops(cfg, T, M).items()})
    return out


def _dynamic_residual_flops(cfg: ModelConfig, T: int, M: int, vector: dict[str, int]) -> dict[str, int]:
    """IRC, CRC and Block AttnRes matmul FLOPs per sequence (ncpctl.model.designs.residual.module): each weight
    MLP (d -> hidden -> candidates) or pseudo-query dot product, and the weighted sums of the
    candidate states (the LayerNorms / RMSNorms of the sources, the pooling of the encoder's depths
    and other elementwise work are not counted). ``crc_mode: input`` is ``residual.crc_input``. The
    depth mixer reports its own cost (``design_cost``: a registered one its ``cost`` attribute)."""
    out = {}
    mixer = design_cost("residual", cfg.residual)
    if mixer is not None:
        shapes = _shapes(cfg, T, M)
        out[mixer.key] = sum(mixer.flops(cfg, stack, shapes) for stack in STACKS)
        if hasattr(mixer, "vector"):
            vector[mixer.key] = sum(mixer.vector(cfg, stack, shapes) for stack in STACKS)
    if cfg.crc_connections:
        out[_crc_key(cfg)] = sum(_crc_flops(cfg, link, T, M) for link in cfg.crc_connections)
        vector[_crc_key(cfg)] = sum(_crc_flops(cfg, link, T, M, vector=True) for link in cfg.crc_connections)
    return out


def _bottleneck_flops(cfg: ModelConfig, T: int, steered: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Steerling's concept bottleneck per sequence, as it reports itself (``BottleneckCost``):
    (forward components, training-only work)."""
    return BottleneckCost.flops(cfg, T, steered) if cfg.bottleneck.enabled else ({}, {})


def _mtp_flops(cfg: ModelConfig, T: int) -> dict[str, tuple[int, int | None]]:
    """The MTP head's forward as it reports itself (``MtpCost``): key -> (full count, causal count or None)."""
    return MtpCost.flops(cfg, T, lambda n: _stack_flops(cfg, [None], n))


def _shapes(cfg: ModelConfig, T: int, M: int) -> dict[str, tuple[int, int]]:
    """(layers, positions) of each stack (encoder, concept, decoder)."""
    return {stack: _stack_shape(cfg, stack, T, M) for stack in STACKS}


def _stack_shape(cfg: ModelConfig, stack: str, T: int, M: int) -> tuple[int, int]:
    """(layers, positions) of the encoder, concept or decoder stack."""
    c = cfg.concept
    return {"encoder": (cfg.encoder_layers, T), "concept": (c.concept_layers if c.enabled else 0, M),
            "decoder": (cfg.decoder_layers, T)}[stack]


def _crc_flops(cfg: ModelConfig, link: str, T: int, M: int, vector: bool = False) -> int:
    """One CRC connection: per target layer (once, on the target's input, with ``crc_mode:
    input``), MLP(T) d -> h -> K, the K sources' sum (a batched matmul, ``residual.DepthMix``) and
    D * M (``vector``: this last, the elementwise part, alone)."""
    d, h = cfg.d_model, cfg.crc_hidden
    source, target = link.split("-")
    K = _stack_shape(cfg, source, T, M)[0] + 1
    n, P = _stack_shape(cfg, target, T, M)
    n = min(n, 1) if cfg.crc_mode == "input" else n
    scale = 2 * P * d
    return n * scale if vector else n * (2 * P * (d * h + h * K) + 2 * P * K * d + scale)
