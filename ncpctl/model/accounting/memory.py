"""Activation memory of one training micro-batch: the bytes of the tensors autograd saves for the
backward pass, per ``train.activation_checkpointing`` mode (accounting.py's fourth view, beside
FLOPs and parameters). Pure arithmetic on the config, except that the backbone family's norm is
built once on the meta device to see whether it is a LayerNorm (torch imported lazily).

What each mode keeps (ncpctl.train.recompute):

* ``none``: every saved tensor of every block: the norms' inputs and statistics, the sub-layers'
  inputs, the fused q/k/v projection (B, T, (H + 2 Hkv) hd), the rotated q and k, SDPA's output
  (B, T, H hd) and log-sum-exp (B, H, T) fp32, the MLP's hidden (B, T, ffn) (SwiGLU: the fused
  [gate; up] (B, T, 2 ffn), silu(gate) and the product; GELU: its input and output).
* ``selective``: per block only the attention / cross / MLP sub-layers' inputs (B, T, d) and the
  norms (which stay outside the checkpoints); while one sub-layer's backward runs, its internals
  are rebuilt (``recompute_peak``).
* ``full``: per block only its input (B, T, d); one block's internals are rebuilt at a time.

Outside the blocks every mode keeps the same: the LM head's fused loss (its (N, V) logits buffer
in the compute dtype, N = B T: the largest tensor at small models), the final norm, the concept
path between the stacks, the depth mixers (IRC keeps each layer's candidate H_l + R_l and its
weight MLP's hidden; CRC its normed sources), the bottleneck and the MTP head's block and logits.

``attention``: ``flash`` (also the memory-efficient and cuDNN kernels, and the CPU's flash kernel
for a causal mask: q, k, v, the output and the log-sum-exp are saved, no T x T scores) or
``math`` (the composite path, taken for explicit masks on some builds and where no fused kernel
applies: the (B, H, T, T) scores and probabilities are saved as well).

Exact for the token and concept stacks (tests/model/test_accounting_memory.py measures the saved
storages of the debug models with ``saved_tensors_hooks``); approximate, to within a few (B, T, d)
tensors per layer, for the concept path's pooling, heads and codebook, the depth mixers, DLCM's
segmentation and cross-attention, the bottleneck and the MTP head. Not counted: the gradients,
parameters and optimizer state, the embedding's integer inputs, the allocator's fragmentation and
the transient buffers of a kernel (e.g. SDPA's backward workspace).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.registry import family

__all__ = ["ActivationMemory", "activation_memory", "DTYPE_BYTES", "ATTENTION_KERNELS", "MODES"]

MODES = ("none", "selective", "full")  # = ncpctl.train.recompute.MODES (no torch import here)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ATTENTION_KERNELS = ("flash", "math")


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes saved for the backward pass of one micro-batch of ``micro_batch`` x ``seq_len``
    tokens. ``kept[mode]``: component -> bytes alive when the forward ends; ``recompute_peak[mode]``:
    the internals one checkpointed module rebuilds during the backward (0 for ``none``)."""

    seq_len: int
    micro_batch: int
    dtype: str
    attention: str
    kept: dict[str, dict[str, int]] = field(default_factory=dict)
    recompute_peak: dict[str, int] = field(default_factory=dict)

    def saved(self, mode: str) -> int:
        """What the forward leaves saved (what ``saved_tensors_hooks`` sees)."""
        return sum(self.kept[mode].values())

    def total(self, mode: str) -> int:
        """The activation peak of the step: what is kept plus one recomputed module's internals."""
        return self.saved(mode) + self.recompute_peak[mode]

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "micro_batch": self.micro_batch, "dtype": self.dtype,
                "attention": self.attention, "kept": {m: dict(v) for m, v in self.kept.items()},
                "recompute_peak": dict(self.recompute_peak),
                "total": {m: self.total(m) for m in self.kept}}


@dataclass(frozen=True)
class _Block:
    """Bytes per position of one block, by what each mode keeps of it."""

    io: int  # the sub-layers' inputs and the norms' saved tensors: kept by none and selective
    attn: int  # attention internals (q/k/v projection, rotated q and k, output, log-sum-exp[, scores])
    cross: int  # a coupling's cross-attention internals (0 without one)
    mlp: int  # MLP internals
    x: int  # the block's input, all that full keeps


@dataclass(frozen=True)
class _Modules:
    """What the built modules say (on the meta device): the family's norm is a LayerNorm, the
    coupling gives decoder blocks a cross sub-layer, the depth mixer is IRC."""

    layer_norm: bool
    cross: bool
    irc: bool


def _modules(cfg: ModelConfig) -> _Modules:
    import torch
    from torch import nn

    from ncpctl.model.core.concept import coupling_layer_factory
    from ncpctl.model.core.config import strategy
    from ncpctl.model.designs.residual.module import IRC

    with torch.device("meta"):
        ln = isinstance(family(cfg.backbone).norm(cfg, 1), nn.LayerNorm)
        cross = cfg.concept.enabled and cfg.decoder_layers > 0 and coupling_layer_factory(cfg)(0) is not None
    mixer = strategy("residual", cfg.residual)
    return _Modules(ln, bool(cross), isinstance(mixer, type) and issubclass(mixer, IRC))


def _norm_bytes(cfg: ModelConfig, b: int, layer_norm: bool) -> tuple[int, int]:
    """(bytes of the norm's input it saves, its other saved bytes) per position, its output not
    included. LayerNorm: its input, mean and rstd (fp32). RMSNorm (computed in fp32,
    layers.RMSNorm): x.float() (the input itself in fp32, a copy otherwise), rsqrt, and the
    normalised x cast back (a new tensor, saved by the weight's product)."""
    d = cfg.d_model
    if layer_norm:
        return b * d, 8
    if b == 4:
        return 4 * d, 4 * d + 4
    return 0, 4 * d + b * d + 4


def _attention_bytes(cfg: ModelConfig, b: int, keys: int, kernel: str, rotary: bool) -> int:
    """Attention internals per query position, keys per query ``keys`` (the math path's scores)."""
    q, kv, H = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_heads
    out = b * (q + 2 * kv)  # the fused projection (v stays a view of it)
    if cfg.clip_qkv is not None:  # clamp keeps its input
        out += b * (q + 2 * kv)
    if cfg.qk_norm != "none":  # RMSNorm of q and k (fp32): x.float() (a copy below fp32), the product, the output
        out += (2 * b if b == 4 else 4 + 2 * b) * (q + kv)
    if rotary:
        out += b * (q + kv)  # the rotated q and k (one new tensor)
    out += b * q + 4 * H  # the output (the out-projection's input) and the log-sum-exp
    if kernel == "math":  # scores and probabilities (B, H, T, T)
        out += 2 * b * H * keys
    return out


def _mlp_bytes(cfg: ModelConfig, b: int) -> int:
    f = cfg.ffn_dim
    # SwiGLU: [gate; up] (2f), silu(gate), their product; GELU: its input and output
    return b * (4 * f if family(cfg.backbone).mlp_matrices == 3 else 2 * f)


def _block(cfg: ModelConfig, b: int, keys: int, kernel: str, cross: bool, layer_norm: bool) -> _Block:
    """One block of ``cfg`` (layers.Block): two (or three, with a cross sub-layer) sub-layers, each
    keeping its input (B, T, d) and its norm's saved tensors. A pre-norm parallel block's two norms
    read the same x: a LayerNorm's saved input is then shared."""
    d = cfg.d_model
    subs = 3 if cross else 2
    shared, own = _norm_bytes(cfg, b, layer_norm)
    norms = subs * own + (shared if cfg.parallel_residual and cfg.norm_placement == "pre" else subs * shared)
    io = subs * b * d + norms
    rotary = cfg.rotary_dim > 0 and not cfg.learned_positions
    attn = _attention_bytes(cfg, b, keys, kernel, rotary)
    # cross-attention: queries (T, H hd) and output, keys and values over the concepts (approximate)
    xattn = b * 2 * cfg.n_heads * cfg.head_dim + 4 * cfg.n_heads if cross else 0
    return _Block(io=io, attn=attn, cross=xattn, mlp=_mlp_bytes(cfg, b), x=b * d)


def _stack(cfg: ModelConfig, windows, n: int, B: int, b: int, kernel: str, cross: bool,
           layer_norm: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(kept bytes per mode, recompute peak per mode) of a stack with ``windows`` on n positions."""
    kept = {m: 0 for m in MODES}
    peak = {m: 0 for m in MODES}
    for w in windows:
        blk = _block(cfg, b, n if w is None else min(n, w) if kernel != "math" else n, kernel, cross, layer_norm)
        inner = blk.attn + blk.cross + blk.mlp
        kept["none"] += B * n * (blk.io + inner)
        kept["selective"] += B * n * blk.io
        kept["full"] += B * n * blk.x
        peak["selective"] = max(peak["selective"], B * n * max(blk.attn, blk.cross, blk.mlp))
        peak["full"] = max(peak["full"], B * n * (blk.io + inner))
    return kept, peak


def _head_bytes(cfg: ModelConfig, T: int, B: int, b: int, layer_norm: bool) -> int:
    """The final norm and the fused LM head (head.py): h (N, d), the (N, V) logits buffer, and per
    row the log-sum-exp (fp32), the target index (int64) and the valid flag."""
    shared, own = _norm_bytes(cfg, b, layer_norm)
    return B * T * (shared + own + b * cfg.d_model + b * cfg.padded_vocab_size + 4 + 8 + 1)


def _concept_path_bytes(cfg: ModelConfig, T: int, M: int, B: int, b: int) -> int:
    """Between the encoder and the decoder (approximate: calibrated on the debug ConceptLM, where
    it is about six (B, M, d) tensors): the pooled concepts and the concept stack's output
    (M, d_c), the heads' code logits and code weights (M, S N), the codebook mix and the prediction
    (M, d) that the decoder input z = h + spread(pred) reads. A segmentation or coupling with matmuls
    of its own (DLCM's boundary predictor and (M, T) pooling, its cross-attention coupling) adds a
    few (T, d) and (M, T) tensors, calibrated on the debug DLCM."""
    c = cfg.concept
    d, dc = cfg.d_model, cfg.concept_cfg.d_model
    SN = cfg.n_segments * c.codes
    out = B * M * b * (3 * d + dc + 2 * SN)
    from ncpctl.model.accounting.parts import SLOTS, _concept_costs

    for slot, _ in _concept_costs(cfg):  # a strategy with its own matmuls (DLCM's), calibrated on debug-dlcm
        if slot == SLOTS["segmentation"]:  # the boundary predictor's q, k and scores (T, d), dense (M, T) pooling
            out += B * b * (3 * T * d + 6 * M * T)
        else:  # a coupling's cross-attention: q, output and the mixed-in states (T, d), k and v (M, d), mask (T, M)
            out += B * b * (4 * T * d + 2 * M * d + T * M)
    return out


def _residual_bytes(cfg: ModelConfig, T: int, M: int, B: int, b: int, irc: bool) -> int:
    """The depth mixers and cross-module residuals (approximate; residual.py). IRC per layer: the
    candidate H_l + R_l and the update R_l (d each), the weight MLP's hidden before and after
    its SiLU and the weights (l + 2). CRC per connection: the K normed source depths at the
    target's positions, and per target layer the MLP's hidden, alpha (K) and the mix m (d)."""
    from ncpctl.model.accounting.parts import STACKS, _stack_shape

    d, out = cfg.d_model, 0
    if irc:
        for stack in STACKS:
            layers, n = _stack_shape(cfg, stack, T, M)
            out += sum(B * n * b * (2 * d + 2 * cfg.irc_hidden + l + 2) for l in range(layers))
    for link in cfg.crc_connections:
        source, target = link.split("-")
        K = _stack_shape(cfg, source, T, M)[0] + 1
        layers, n = _stack_shape(cfg, target, T, M)
        layers = min(layers, 1) if cfg.crc_mode == "input" else layers
        out += B * n * b * (K * d + layers * (2 * cfg.crc_hidden + K + d))
    return out


def _extras(cfg: ModelConfig, T: int, M: int, B: int, b: int, mods: _Modules,
            kernel: str) -> tuple[dict[str, int], dict[str, int]]:
    """The parts no mode recomputes, by component (approximate), and MTP's blocks by mode."""
    out: dict[str, int] = {}
    mtp = {m: 0 for m in MODES}
    if cfg.concept.enabled:
        out["concept_path"] = _concept_path_bytes(cfg, T, M, B, b)
    res = _residual_bytes(cfg, T, M, B, b, mods.irc)
    layer_norm = mods.layer_norm
    if res:
        out["residual"] = res
    if cfg.bottleneck.enabled:  # kK + uU + e: the known and unknown activations (top-k kept dense), ~4 (T, d)
        bn = cfg.bottleneck
        out["bottleneck"] = B * T * b * (2 * bn.concepts + 2 * cfg.bottleneck_unknown + 2 * cfg.bottleneck_rank + 4 * cfg.d_model)
    if cfg.mtp_depth:  # per depth: the combining projection's input (2d), one block, a second LM head
        kept, _ = _stack(cfg, [None] * cfg.mtp_depth, T, B, b, kernel, False, layer_norm)
        for m in MODES:
            mtp[m] = kept[m] + cfg.mtp_depth * (B * T * b * 2 * cfg.d_model + _head_bytes(cfg, T, B, b, layer_norm))
    return out, mtp


def activation_memory(cfg: ModelConfig, seq_len: int | None = None, micro_batch: int = 1, dtype: str = "bf16",
                      attention: str = "flash", realised_ratio: float | None = None) -> ActivationMemory:
    """Bytes saved for the backward pass of one ``micro_batch`` x ``seq_len`` micro-batch of
    ``cfg`` in ``dtype`` (the model's weights and activations: fp32, bf16 or fp16), per
    ``train.activation_checkpointing`` mode, with SDPA's ``attention`` kernel (flash: no T x T
    scores; math: with them). A dynamic segmentation's concepts are counted at its target R, or at
    ``realised_ratio`` tokens per concept (``at_realised_ratio``: the concept stack's memory follows
    the concepts a batch really has). See the module docstring for what is exact and what approximate."""
    from ncpctl.model.accounting.flops import at_realised_ratio

    cfg = at_realised_ratio(cfg, realised_ratio)
    T = int(seq_len if seq_len is not None else cfg.max_seq_len)
    if T <= 0 or micro_batch <= 0:
        raise ValueError(f"seq_len and micro_batch must be positive, got {T}, {micro_batch}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTION_KERNELS)}")
    b, B, mods = DTYPE_BYTES[dtype], micro_batch, _modules(cfg)
    ln, cross, M = mods.layer_norm, mods.cross, cfg.expected_concepts(T)
    stacks = {"encoder": _stack(cfg, cfg.token_windows[:cfg.encoder_layers], T, B, b, attention, False, ln),
              "decoder": _stack(cfg, cfg.token_windows[cfg.encoder_layers:], T, B, b, attention, cross, ln)}
    if cfg.concept.enabled:
        stacks["concept_layers"] = _stack(cfg.concept_cfg, cfg.concept_windows, M, B, b, attention, False, ln)
    extras, mtp = _extras(cfg, T, M, B, b, mods, attention)
    shared = {"embedding": B * T * b * cfg.d_model * (2 if cfg.learned_positions else 0),
              "head": _head_bytes(cfg, T, B, b, ln), **extras}
    kept: dict[str, dict[str, int]] = {}
    peak: dict[str, int] = {}
    for m in MODES:
        tok = stacks["encoder"][0][m] + stacks["decoder"][0][m]
        kept[m] = {"token_layers": tok, **({"concept_layers": stacks["concept_layers"][0][m]} if M else {}),
                   **{k: v for k, v in shared.items() if v}, **({"mtp": mtp[m]} if mtp[m] else {})}
        peak[m] = max(s[1][m] for s in stacks.values())
    return ActivationMemory(seq_len=T, micro_batch=B, dtype=dtype, attention=attention, kept=kept, recompute_peak=peak)
