"""Cost accounting for an NCP model: FLOPs (paper and exact view) and parameter counts.

Spec: shared/docs/ncp-model.md section 6. Three views of one ``ModelConfig``:

* ``paper_flops``: the ConceptLM App. C simplification. A token layer costs
  ``12*T*d^2 + 2*T^2*d`` per sequence (forward), a concept layer the same at its own width d_c on
  ``T/k`` positions, ``12*(T/k)*d_c^2 + 2*(T/k)^2*d_c`` (k: the segmentation's mean tokens per
  concept, its ``SegmentationLaw``; the block length for fixed blocks; d_c = ``concept.d_concept``,
  d unless set); training = 3x forward. In the token width d, with w = d_c / d, L token and C
  concept layers: ``12*(L + C w^2/k)*T*d^2 + 2*(L + C w/k^2)*T^2*d``. The two coefficients are
  returned so the formula can be printed symbolically (PM: ``408*T*d^2 + 68*T^2*d``; ConceptLM:
  ``390*T*d^2 + 64.25*T^2*d``; DLCM 2.3B, w = 2, k = 4: ``384*T*d^2 + 36*T^2*d``).
* ``exact_flops``: matmul FLOPs (2 per multiply-add) with the real shapes (GQA, FFN width
  and gating, sliding window, padded vocab, concept heads, codebook), by component. Training
  is 3x forward when every weight trains; a stage that freezes weights (adapt-vq, LoRA) passes
  its trainable parameters and gets the backward it really does (accounting_backward.py).
  Steerling's concept bottleneck (``bottleneck.*``) is counted too; its unknown head reads sg(h),
  so the 3x convention overcounts it by g's (first) input gradient, which the backward walk omits.
* ``count_parameters``: the real ``NCPModel`` built on the meta device, grouped by
  component. Only this one imports torch (lazily), so the CLI can describe configs cheaply.

Everything here is pure arithmetic on the config except ``count_parameters``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ncpctl.model.accounting_params import PARAM_GROUPS, ParamCounts, count_parameters  # noqa: F401 (re-exported)
from ncpctl.model.config import ModelConfig
from ncpctl.model.family import family
from ncpctl.model.registry import design_cost

__all__ = [
    "PaperFlops",
    "ExactFlops",
    "ParamCounts",
    "Accounting",
    "paper_flops",
    "exact_flops",
    "count_parameters",
    "describe",
    "saving",
    "parameter_equivalent_layers",
    "at_realised_ratio",
    "PARAM_GROUPS",
]

# Training = forward + backward (2x forward: grads w.r.t. activations and weights).
TRAIN_MULTIPLIER = 3


def _concept_layers(cfg: ModelConfig) -> int:
    return cfg.concept.concept_layers if cfg.concept.enabled else 0


def parameter_equivalent_layers(cfg: ModelConfig) -> int:
    """Layers holding the same parameters: token layers + C (NCP-ArchPreview Table 2: 40)."""
    return cfg.n_token_layers + _concept_layers(cfg)


def saving(baseline: float, other: float) -> float:
    """Fraction of ``baseline`` saved by ``other``: ``(baseline - other) / baseline``."""
    return (baseline - other) / baseline


def _fmt(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------------------
# Paper view (ConceptLM App. C)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperFlops:
    """Forward cost per sequence = ``coef_Td2*T*d^2 + coef_T2d*T^2*d`` (d the token width);
    training = 3x."""

    seq_len: int  # T
    d_model: int  # d
    d_concept: int | None  # d_c, the concept layers' width (None without the path)
    token_layers: int  # E + D (+ PM's extra layers)
    concept_layers: int  # C (0 without the concept path)
    k: float | None  # tokens per concept: the block length k for fixed blocks (None without the path)
    coef_Td2: float  # 12 * (token layers + C w^2/k), w = d_c / d
    coef_T2d: float  # 2 * (token layers + C w/k^2)
    block_equivalents: float  # token layers + C w^2/k (from the config) = coef_Td2 / 12
    parameter_equivalent_layers: int  # token layers + C
    forward_per_sequence: float
    training_per_sequence: float
    forward_per_token: float
    training_per_token: float

    @property
    def formula(self) -> str:
        """Forward formula, e.g. ``390*T*d^2 + 64.25*T^2*d``."""
        return f"{_fmt(self.coef_Td2)}*T*d^2 + {_fmt(self.coef_T2d)}*T^2*d"

    @property
    def training_formula(self) -> str:
        m = TRAIN_MULTIPLIER
        return f"{_fmt(m * self.coef_Td2)}*T*d^2 + {_fmt(m * self.coef_T2d)}*T^2*d"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["formula"] = self.formula
        out["training_formula"] = self.training_formula
        return out


def paper_flops(cfg: ModelConfig, seq_len: int | None = None, realised_ratio: float | None = None) -> PaperFlops:
    """ConceptLM App. C cost of ``cfg`` at ``seq_len`` (default ``cfg.max_seq_len``); a dynamic
    segmentation's concepts at ``realised_ratio`` tokens each instead of R (``at_realised_ratio``)."""
    cfg = at_realised_ratio(cfg, realised_ratio)
    T = int(seq_len if seq_len is not None else cfg.max_seq_len)
    if T <= 0:
        raise ValueError(f"seq_len must be positive, got {T}")
    d = cfg.d_model
    L = cfg.n_token_layers
    C = _concept_layers(cfg)
    k = tokens_per_concept(cfg)
    dc = cfg.concept_cfg.d_model if cfg.concept.enabled else None
    w = dc / d if dc else 1.0
    # A concept layer at width d_c = w d on T/k positions: 12*(T/k)*d_c^2 + 2*(T/k)^2*d_c
    # = (12 w^2/k)*T*d^2 + (2 w/k^2)*T^2*d.
    coef_Td2 = 12.0 * L + (12.0 * C * w * w / k if C else 0.0)
    coef_T2d = 2.0 * L + (2.0 * C * w / (k * k) if C else 0.0)
    fwd = coef_Td2 * T * d * d + coef_T2d * T * T * d
    return PaperFlops(
        seq_len=T,
        d_model=d,
        d_concept=dc,
        token_layers=L,
        concept_layers=C,
        k=k,
        coef_Td2=coef_Td2,
        coef_T2d=coef_T2d,
        block_equivalents=cfg.block_equivalents,
        parameter_equivalent_layers=parameter_equivalent_layers(cfg),
        forward_per_sequence=fwd,
        training_per_sequence=TRAIN_MULTIPLIER * fwd,
        forward_per_token=fwd / T,
        training_per_token=TRAIN_MULTIPLIER * fwd / T,
    )


# --------------------------------------------------------------------------------------
# Exact view (matmul FLOPs with the real shapes)
# --------------------------------------------------------------------------------------


def tokens_per_concept(cfg: ModelConfig) -> float | int | None:
    """The segmentation's mean tokens per concept (an int when whole, e.g. k = 4)."""
    r = cfg.tokens_per_concept
    return int(r) if r is not None and float(r).is_integer() else r


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


@dataclass(frozen=True)
class ExactFlops:
    """Exact matmul FLOPs (2 per multiply-add) of one training/inference step.

    ``components``: forward FLOPs of ONE sequence of ``seq_len`` tokens, attention counted
    as SDPA computes it (every query against min(T, window) keys), except
    ``concept.codebook_transform`` which runs once per step whatever the batch (the codes
    are recomputed from the frozen base each forward). ``attention_causal`` gives the
    causal-mask count for the attention entries. The ``mtp.*`` entries (the MTP head,
    ``model.mtp_depth``) run in training only: decoding and the export drop the head, so an
    inference count leaves them out. ``training_only``: per-sequence work done
    only in training (nearest-code search for the VQ loss; no backward through the argmin).
    Per-sequence and per-token totals spread the per-step work over ``batch_size``.
    """

    seq_len: int
    batch_size: int
    concept_positions: int  # M = T // k (0 without the concept path)
    components: dict[str, int] = field(default_factory=dict)
    attention_causal: dict[str, int] = field(default_factory=dict)
    training_only: dict[str, int] = field(default_factory=dict)
    # backward FLOPs by component (per sequence, PER_STEP entries per step; attention entries
    # full-count, ``backward_causal`` their causal count) when a stage freezes weights; None =
    # every weight trains: backward = 2x forward (the TRAIN_MULTIPLIER convention)
    backward: dict[str, int] | None = None
    backward_causal: dict[str, int] = field(default_factory=dict)

    PER_STEP = ("concept.codebook_transform",)

    def _step_sum(self, comps: dict[str, int], causal_part: dict[str, int], causal: bool) -> int:
        comps = {**comps, **causal_part} if causal else comps
        per_seq = sum(v for k, v in comps.items() if k not in self.PER_STEP)
        per_step = sum(v for k, v in comps.items() if k in self.PER_STEP)
        return self.batch_size * per_seq + per_step

    def _forward_step(self, causal: bool) -> int:
        return self._step_sum(self.components, self.attention_causal, causal)

    def forward_per_step(self, causal: bool = False) -> int:
        return self._forward_step(causal)

    def backward_per_step(self, causal: bool = False) -> int:
        if self.backward is None:
            return (TRAIN_MULTIPLIER - 1) * self._forward_step(causal)
        return self._step_sum(self.backward, self.backward_causal, causal)

    def training_per_step(self, causal: bool = False) -> int:
        extra = self.batch_size * sum(self.training_only.values())
        if self.backward is None:
            return TRAIN_MULTIPLIER * self._forward_step(causal) + extra
        return self._forward_step(causal) + self.backward_per_step(causal) + extra

    # ---- totals (full-attention count; *_causal with the causal mask) ----
    @property
    def forward_per_sequence(self) -> float:
        return self.forward_per_step() / self.batch_size

    @property
    def forward_per_sequence_causal(self) -> float:
        return self.forward_per_step(causal=True) / self.batch_size

    @property
    def training_per_sequence(self) -> float:
        return self.training_per_step() / self.batch_size

    @property
    def training_per_sequence_causal(self) -> float:
        return self.training_per_step(causal=True) / self.batch_size

    @property
    def forward_per_token(self) -> float:
        return self.forward_per_sequence / self.seq_len

    @property
    def forward_per_token_causal(self) -> float:
        return self.forward_per_sequence_causal / self.seq_len

    @property
    def training_per_token(self) -> float:
        return self.training_per_sequence / self.seq_len

    @property
    def training_per_token_causal(self) -> float:
        return self.training_per_sequence_causal / self.seq_len

    @property
    def layer_flops(self) -> int:
        """Forward FLOPs of the token and concept layers only (per sequence, full count)."""
        return sum(v for k, v in self.components.items() if k.startswith(("token_layers.", "concept_layers.")))

    def _concept_share(self, causal: bool) -> float:
        comps = dict(self.components)
        if causal:
            comps.update(self.attention_causal)
        concept = sum(
            (v if k in self.PER_STEP else self.batch_size * v)
            for k, v in comps.items()
            if k.startswith(("concept.", "concept_layers."))
        )
        return concept / self._forward_step(causal)

    @property
    def concept_share(self) -> float:
        """Fraction of forward FLOPs spent on the concept path (pooling .. codebook)."""
        return self._concept_share(causal=False)

    @property
    def residual_share(self) -> float:
        """Fraction of forward FLOPs spent in the dynamic residuals (IRC, CRC, Block AttnRes: every
        ``residual.*`` component; NCP-ArchPreview Table 3's overhead)."""
        extra = sum(v for k, v in self.components.items() if k.startswith("residual."))
        return self.batch_size * extra / self._forward_step(causal=False)

    @property
    def concept_share_causal(self) -> float:
        return self._concept_share(causal=True)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "concept_positions": self.concept_positions,
            "components": dict(self.components),
            "attention_causal": dict(self.attention_causal),
            "training_only": dict(self.training_only),
        }
        if self.backward is not None:
            out["backward"], out["backward_causal"] = dict(self.backward), dict(self.backward_causal)
        for name in (
            "forward_per_sequence", "forward_per_sequence_causal",
            "training_per_sequence", "training_per_sequence_causal",
            "forward_per_token", "forward_per_token_causal",
            "training_per_token", "training_per_token_causal",
            "layer_flops", "concept_share", "concept_share_causal", "residual_share",
        ):
            out[name] = getattr(self, name)
        return out


def at_realised_ratio(cfg: ModelConfig, ratio: float | None) -> ModelConfig:
    """``cfg`` costed at a measured compression: a data-dependent segmentation (DLCM's dynamic
    boundaries) counts its concepts at the target R (T // R); a trained model realises its own
    tokens per concept (validation's ``tokens_per_concept``, DLCM Table 4: 3.92 or 3.15 at R = 4),
    so the FLOPs at that ratio are those of the same model with R replaced by it. The parameters
    do not depend on R. None: ``cfg`` itself. Fixed blocks have no realised ratio other than k."""
    if ratio is None:
        return cfg
    c = cfg.concept
    if not c.enabled or not cfg.law.variable_length:
        raise ValueError("a realised ratio applies to model.concept.segmentation: dynamic (fixed blocks: k)")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1:
        raise ValueError(f"the realised tokens per concept must be a number > 1, got {ratio!r}")
    return dataclasses.replace(cfg, concept=dataclasses.replace(c, target_ratio=float(ratio)))


def exact_flops(cfg: ModelConfig, seq_len: int | None = None, batch_size: int = 1,
                trainable: Mapping[str, int] | None = None, realised_ratio: float | None = None) -> ExactFlops:
    """Exact matmul FLOPs of ``cfg`` at ``seq_len`` (default ``cfg.max_seq_len``).

    Elementwise work (norms, rotary, softmax, residual adds) is not counted; pooling is,
    as ``k`` adds/divides per pooled element.

    ``trainable``: the parameters that get gradients, name -> element count, as
    ``model.named_parameters()`` names them after the stage's set-up (peft's LoRA names
    ``.base_layer.`` / ``.lora_A.`` / ``.lora_B.`` understood); the backward then counts what
    autograd computes: a weight gradient only for a trained weight, an input gradient only where
    something upstream trains, nothing below the lowest trained parameter. LoRA adapters add
    their own matmuls (``components["adapters"]``). None: every weight trains (3x forward).

    ``realised_ratio``: count a dynamic segmentation's concepts at this measured tokens per
    concept instead of the target R (``at_realised_ratio``).
    """
    cfg = at_realised_ratio(cfg, realised_ratio)
    T = int(seq_len if seq_len is not None else cfg.max_seq_len)
    if T <= 0 or batch_size <= 0:
        raise ValueError(f"seq_len and batch_size must be positive, got {T}, {batch_size}")
    d = cfg.d_model
    comps: dict[str, int] = {}
    causal: dict[str, int] = {}
    training_only: dict[str, int] = {}

    tok = _stack_flops(cfg, cfg.token_windows, T)
    for key in ("qkv", "attn_out", "mlp", "attention"):
        comps[f"token_layers.{key}"] = tok[key]
    causal["token_layers.attention"] = tok["attention_causal"]

    M = 0
    c = cfg.concept
    if c.enabled:
        # the segmentation's law (fixed blocks: T // k, a partial block not pooled; dynamic: T // R)
        M = cfg.expected_concepts(T)
        S, N, ds = cfg.n_segments, c.codes, cfg.segment_dim
        comps["concept.pooling"] = round(M * cfg.tokens_per_concept) * d  # one add per pooled element
        dc = cfg.concept_cfg.d_model  # the concept transformer's width (d unless concept.d_concept)
        if dc != d:
            comps["concept.up"] = 2 * M * d * dc  # W_up: (B,M,d) -> (B,M,d_c)
        con = _stack_flops(cfg.concept_cfg, cfg.concept_windows, M)
        for key in ("qkv", "attn_out", "mlp", "attention"):
            comps[f"concept_layers.{key}"] = con[key]
        causal["concept_layers.attention"] = con["attention_causal"]
        comps["concept.heads"] = 2 * M * dc * S * N  # fused Linear(d_c, S*N): (B,M,d_c)->(B,M,S*N)
        # einsum (B,M,S,N) x (S,N,d/S) -> (B,M,S,d/S)
        comps["concept.codebook_einsum"] = 2 * M * S * N * ds
        # codes = Linear(ds,2ds) -> ReLU -> Linear(2ds,ds) on the (S,N,ds) base, once per step
        comps["concept.codebook_transform"] = 2 * S * N * (ds * 2 * ds) * 2 if c.codebook == "simvq" else 0
        # nearest code per segment of sg(c): (B,M,S,ds) x (S,N,ds) distances, forward only
        training_only["concept.vq_quantise"] = 2 * M * S * N * ds

    comps.update(_dynamic_residual_flops(cfg, T, M))
    bottleneck, bottleneck_training = _bottleneck_flops(cfg, T)
    comps.update(bottleneck)
    training_only.update(bottleneck_training)
    comps.update(_dlcm_flops(cfg, T, M))
    comps["lm_head"] = 2 * T * d * cfg.padded_vocab_size
    for key, (full, causal_part) in _mtp_flops(cfg, T).items():
        comps[key] = full
        if causal_part is not None:
            causal[key] = causal_part
    backward = backward_causal = None
    if trainable is not None:
        from ncpctl.model.accounting_backward import Backward  # a partly frozen model

        bw = Backward(cfg, trainable)
        bw.model(T, M, comps)
        if bw.adapters:
            comps["adapters"] = bw.adapters
        backward, backward_causal = bw.flops, bw.causal
    return ExactFlops(
        seq_len=T,
        batch_size=batch_size,
        concept_positions=M,
        components=comps,
        attention_causal=causal,
        training_only=training_only,
        backward=backward,
        backward_causal=backward_causal or {},
    )


STACKS = ("encoder", "concept", "decoder")


def _crc_key(cfg: ModelConfig) -> str:
    return "residual.crc_input" if cfg.crc_mode == "input" else "residual.crc"
def _dlcm_flops(cfg: ModelConfig, T: int, M: int) -> dict[str, int]:
    """The segmentation's and the coupling's own matmuls at M concepts, as each design reports them
    (``design_cost``; DLCM: the boundary predictor's W_q, W_k, the cross-attention's projections,
    scores and weighted sum). Fixed blocks and the additive coupling have none."""
    c, out = cfg.concept, {}
    if not c.enabled:
        return out
    for kind, name in (("segmentation", c.segmentation), ("coupling", c.coupling)):
        cost = design_cost(kind, name)
        if cost is not None:
            out.update(cost.flops(cfg, T, M))
    return out


def _dynamic_residual_flops(cfg: ModelConfig, T: int, M: int) -> dict[str, int]:
    """IRC, CRC and Block AttnRes matmul FLOPs per sequence (ncpctl.model.residual): each weight
    MLP (d -> hidden -> candidates) or pseudo-query dot product, and the weighted sums of the
    candidate states (the LayerNorms / RMSNorms of the sources, the pooling of the encoder's depths
    and other elementwise work are not counted). ``crc_mode: input`` is ``residual.crc_input``. The
    depth mixer reports its own cost (``design_cost``: a registered one its ``cost`` attribute)."""
    out = {}
    mixer = design_cost("residual", cfg.residual)
    if mixer is not None:
        shapes = _shapes(cfg, T, M)
        out[mixer.key] = sum(mixer.flops(cfg, stack, shapes) for stack in STACKS)
    if cfg.crc_connections:
        out[_crc_key(cfg)] = sum(_crc_flops(cfg, link, T, M) for link in cfg.crc_connections)
    return out


def _bottleneck_flops(cfg: ModelConfig, T: int) -> tuple[dict[str, int], dict[str, int]]:
    """Steerling's concept bottleneck (ncpctl.model.bottleneck) per sequence: (forward components,
    training-only work). Forward: f (d -> n), k K (n -> d), g (d -> m), u A (m -> r), (u A) B (r -> d).
    Training only, each counted with its own backward: the independence penalty's cross-covariance
    (B*T, d)^T (B*T, d), forward and both operands' gradients (3x; twice with the residual term),
    and the reconstruction target k_true K of the labels (forward only: labels and sg(K))."""
    if not cfg.bottleneck.enabled:
        return {}, {}
    d, n, m, r = cfg.d_model, cfg.bottleneck.concepts, cfg.bottleneck_unknown, cfg.bottleneck_rank
    comps = {"bottleneck.known": 2 * T * d * n, "bottleneck.known_embed": 2 * T * n * d,
             "bottleneck.unknown": 2 * T * d * m if cfg.bottleneck.unknown_head == "dense" else 2 * T * r * (d + m),
             "bottleneck.unknown_A": 2 * T * m * r,
             "bottleneck.unknown_B": 2 * T * r * d}
    pairs = 2 if cfg.bottleneck.independence == "known_unknown_residual" else 1
    training = {"bottleneck.independence": 3 * pairs * 2 * T * d * d, "bottleneck.reconstruction_target": 2 * T * n * d}
    return comps, training


def _mtp_flops(cfg: ModelConfig, T: int) -> dict[str, tuple[int, int | None]]:
    """The MTP head's forward (ncpctl.model.mtp; training only: decoding and the export drop it):
    depth k on the T - k positions that have a target, proj (2d -> d), one full-attention layer and
    the shared LM head. key -> (full count, causal count or None)."""
    d, out = cfg.d_model, {}
    for k in range(1, (cfg.mtp_depth or 0) + 1):
        n = T - k
        if n <= 0:
            break
        layer = _stack_flops(cfg, [None], n)
        parts = {"mtp.proj": (2 * n * 2 * d * d, None),
                 "mtp.layers": (layer["qkv"] + layer["attn_out"] + layer["mlp"], None),
                 "mtp.attention": (layer["attention"], layer["attention_causal"]),
                 "mtp.lm_head": (2 * n * d * cfg.padded_vocab_size, None)}
        for key, (f, c) in parts.items():
            f0, c0 = out.get(key, (0, None if c is None else 0))
            out[key] = (f0 + f, None if c is None else c0 + c)
    return out


def _shapes(cfg: ModelConfig, T: int, M: int) -> dict[str, tuple[int, int]]:
    """(layers, positions) of each stack (encoder, concept, decoder)."""
    return {stack: _stack_shape(cfg, stack, T, M) for stack in STACKS}


def _stack_shape(cfg: ModelConfig, stack: str, T: int, M: int) -> tuple[int, int]:
    """(layers, positions) of the encoder, concept or decoder stack."""
    c = cfg.concept
    return {"encoder": (cfg.encoder_layers, T), "concept": (c.concept_layers if c.enabled else 0, M),
            "decoder": (cfg.decoder_layers, T)}[stack]


def _crc_flops(cfg: ModelConfig, link: str, T: int, M: int) -> int:
    """One CRC connection: per target layer (once, on the target's input, with ``crc_mode:
    input``), MLP(T) d -> h -> K, the K sources' sum and D * M."""
    d, h = cfg.d_model, cfg.crc_hidden
    source, target = link.split("-")
    K = _stack_shape(cfg, source, T, M)[0] + 1
    n, P = _stack_shape(cfg, target, T, M)
    n = min(n, 1) if cfg.crc_mode == "input" else n
    return n * (2 * P * (d * h + h * K) + 2 * P * K * d + 2 * P * d)


# --------------------------------------------------------------------------------------
# Everything at once (for `--json`)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accounting:
    config_name: str
    paper: PaperFlops
    exact: ExactFlops
    params: ParamCounts | None  # None when not requested (no torch needed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config_name,
            "paper": self.paper.to_dict(),
            "exact": self.exact.to_dict(),
            "params": self.params.to_dict() if self.params is not None else None,
        }


def describe(
    cfg: ModelConfig, seq_len: int | None = None, batch_size: int = 1, params: bool = True
) -> Accounting:
    """Paper and exact FLOPs of ``cfg`` and (with ``params``, which imports torch) its counts."""
    return Accounting(
        config_name=cfg.name,
        paper=paper_flops(cfg, seq_len),
        exact=exact_flops(cfg, seq_len, batch_size),
        params=count_parameters(cfg) if params else None,
    )
