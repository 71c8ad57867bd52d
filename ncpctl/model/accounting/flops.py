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

The activations a training micro-batch saves for its backward, per activation-checkpointing mode,
are accounting_memory.py's ``activation_memory``.

Everything here is pure arithmetic on the config except ``count_parameters``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ncpctl.model.accounting.params import PARAM_GROUPS, ParamCounts, count_parameters  # noqa: F401 (re-exported)
from ncpctl.model.accounting.parts import _bottleneck_flops, _design_flops, _dynamic_residual_flops, _mtp_flops, _stack_flops
from ncpctl.model.core.config import ModelConfig

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
    "FLOP_CONVENTION",
]

# Training = forward + backward (2x forward: grads w.r.t. activations and weights).
TRAIN_MULTIPLIER = 3

# The one FLOP convention of budgets (train.max_flops), fits (`ncpctl fit`'s C) and MFU (the training
# loop's, profile-kernels' step): attention counted in full, every query against every key it is
# computed against, none skipped under the causal mask (the PaLM / Megatron MFU convention, which
# keeps a kernel's skipped blocks from counting as work it did not do). Every output that prints
# FLOPs or MFU names it; the causal-mask count is printed under its own `*_causal` key.
FLOP_CONVENTION = "full attention (PaLM/Megatron MFU convention; causal-mask count under *_causal)"
FLOP_CONVENTION_SHORT = "full-attention FLOPs"


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
    # the part of each component that is not a GEMM (forward ``vector``, backward
    # ``vector_backward`` when a stage freezes weights): elementwise and matrix-vector work (fixed
    # blocks' pooling adds, the depth mixers' weighted sums, Block AttnRes's pseudo-query logits),
    # which runs at memory bandwidth, not at a GEMM's peak, and which torch's FlopCounterMode does
    # not count (``gemm_training_per_step``)
    vector: dict[str, int] = field(default_factory=dict)
    vector_backward: dict[str, int] = field(default_factory=dict)

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

    def gemm_training_per_step(self, causal: bool = False) -> int:
        """``training_per_step`` without the ``vector`` work: the GEMMs (matmuls, batched matmuls,
        attention) alone, what a GEMM counter such as torch's FlopCounterMode sees."""
        fwd = self.batch_size * sum(self.vector.values())
        bwd = (TRAIN_MULTIPLIER - 1) * fwd if self.backward is None else self.batch_size * sum(self.vector_backward.values())
        return self.training_per_step(causal) - fwd - bwd

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
            "vector": dict(self.vector),
        }
        if self.backward is not None:
            out["backward"], out["backward_causal"] = dict(self.backward), dict(self.backward_causal)
            out["vector_backward"] = dict(self.vector_backward)
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
                trainable: Mapping[str, int] | None = None, realised_ratio: float | None = None,
                steered_positions: float | None = None) -> ExactFlops:
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

    ``steered_positions``: in a steering stage (Steerling's, the bottleneck's express loss), the
    injected positions per sequence, which the data decide (a steered row is injected where its
    causal labels carry the drawn concept); None counts every position of a steered row,
    ``steer_fraction * T``, an upper bound.
    """
    cfg = at_realised_ratio(cfg, realised_ratio)
    T = int(seq_len if seq_len is not None else cfg.max_seq_len)
    if T <= 0 or batch_size <= 0:
        raise ValueError(f"seq_len and batch_size must be positive, got {T}, {batch_size}")
    d = cfg.d_model
    comps: dict[str, int] = {}
    causal: dict[str, int] = {}
    training_only: dict[str, int] = {}
    vector: dict[str, int] = {}

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
        # one add per pooled element (a segmentation pooling otherwise reports its own: design_cost)
        comps["concept.pooling"] = vector["concept.pooling"] = round(M * cfg.tokens_per_concept) * d
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
        # codes = transform(base) on the (S,N,ds) base, once per step (an MLP ds -> 2ds -> ds, or ds -> ds)
        comps["concept.codebook_transform"] = sum(2 * S * N * i * o for i, o, _ in c.transform_layers(ds)) \
            if c.codebook == "simvq" else 0
        # nearest code per segment of sg(c): (B,M,S,ds) x (S,N,ds) distances, forward only
        training_only["concept.vq_quantise"] = 2 * M * S * N * ds

    comps.update(_dynamic_residual_flops(cfg, T, M, vector))
    bottleneck, bottleneck_training = _bottleneck_flops(cfg, T, steered_positions)
    comps.update(bottleneck)
    training_only.update(bottleneck_training)
    for key, (f, v) in _design_flops(cfg, T, M).items():
        comps[key] = f
        if v:
            vector[key] = v
        else:
            vector.pop(key, None)
    comps["lm_head"] = 2 * T * d * cfg.padded_vocab_size
    for key, (full, causal_part) in _mtp_flops(cfg, T).items():
        comps[key] = full
        if causal_part is not None:
            causal[key] = causal_part
    backward = backward_causal = None
    if trainable is not None:
        from ncpctl.model.accounting.backward import Backward  # a partly frozen model

        bw = Backward(cfg, trainable)
        bw.model(T, M, comps, vector)
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
        vector=vector,
        vector_backward=bw.vector if trainable is not None else {},
    )


def training_flops_per_step(cfg: ModelConfig, seq_len: int, global_batch_size: int, *,
                            trainable: Mapping[str, int] | None = None, realised_ratio: float | None = None) -> int:
    """Training FLOPs of one optimizer step (global_batch_size sequences of seq_len tokens, full
    attention count): the one number a FLOPs budget divides, a sweep's ``--dry`` and a fit's compute
    multiply by the steps, and MFU divides (``Recipe.flops_per_step`` at a recipe's own length and
    batch). ``trainable`` / ``realised_ratio``: as ``exact_flops``."""
    return exact_flops(cfg, seq_len, global_batch_size, trainable=trainable,
                       realised_ratio=realised_ratio).training_per_step()


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
