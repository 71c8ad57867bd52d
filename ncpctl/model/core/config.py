"""`ModelConfig`: the one typed description of an NCP model (shared/docs/ncp-model.md).

Pure Python (no torch import) so recipes can be validated before any heavy import.
Derived numbers (head size, padded vocab, FFN width, segment width, encoder/decoder split,
block-equivalent count) are computed once in ``__post_init__``; nothing else recomputes
them. Every way a config can be impossible is collected as ``(field, message)`` pairs and
raised together as ``ConfigError`` so the recipe layer can report all of them at once.

Named sizes are data (``SIZES``); ``build_config(size, **overrides)`` merges them.

What every model has is declared here; each design's own keys are a *section* in a module next
to the design (config_dynamic.py, config_coupling.py, config_residual.py, config_mtp.py,
config_mup.py, config_bottleneck.py: dataclass mixins with their checks, config_base.py) that
``ModelConfig`` and ``ConceptConfig`` inherit, so recipes, attributes and checkpoints keep one
flat layout (``model.irc_hidden``, ``cfg.concept.boundary_mode``). The extension points' names,
laws and the keys registered designs declare (``model.options.NAME.KEY``) are in registry.py
(re-exported here).

This module and the rest of ``ncpctl/model/`` (but ``hf.py`` and ``accounting.py``) are copied
verbatim into exported Hugging Face directories: they import nothing from ``ncpctl``, only each
other, with relative imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ncpctl.model.core.config_base import (  # noqa: F401
    ConfigError, SegmentationLaw, is_positive_int, option, section_problems, section_seq_len, section_settle, section_tokens,
)
from ncpctl.model.registry import (  # noqa: F401  (the registry's names, as before it had its own module)
    LAWS, OPTIONS, STRATEGIES, UNTRUSTED, family, sections, _check_options, from_checkpoint, register, segmentation_law,
    strategy, trust, unregister,
)

ROPE_TYPES = ("llama3",)  # rope_scaling types rope() implements (HF's names)
INIT_SCHEMES = ("hf", "gpt2", "gpt-neox")  # model.init values (weight-init schemes; gpt2 here is not the family)


def _check_rope_scaling(rs: Any) -> list[tuple[str, str]]:
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if not isinstance(rs, dict) or rs.get("rope_type") not in ROPE_TYPES:
        got = rs.get("rope_type") if isinstance(rs, dict) else rs
        return [("rope_scaling", f"rope_type {got!r} is not supported (supported: {', '.join(ROPE_TYPES)})")]
    bad = [k for k in keys if not isinstance(rs.get(k), (int, float)) or isinstance(rs.get(k), bool) or rs[k] <= 0]
    extra = sorted(set(rs) - {"rope_type", *keys})
    out = [("rope_scaling", f"{k}: a positive number is required") for k in bad]
    if extra:
        out.append(("rope_scaling", f"unknown llama3 field(s): {', '.join(extra)}"))
    if not bad and rs["high_freq_factor"] <= rs["low_freq_factor"]:
        out.append(("rope_scaling", "high_freq_factor must exceed low_freq_factor"))
    return out


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


_f = option  # a documented dataclass field (config_base.option)


@dataclass
class ConceptConfig(*sections("concept")):  # the built-in designs' sections (their DesignSpecs), in order
    """The concept path (spec sections 1-3). Defaults follow ConceptLM (Pythia). The keys of one
    segmentation or coupling are its section (config_dynamic.py, config_coupling.py); those of the
    heads and the codebook transform, config_concept_head.py."""

    enabled: bool = _f(False, "Turn the concept path on (ConceptLM); off = exactly the HF backbone.")
    segmentation: str = _f(
        "fixed", "How tokens are grouped into concepts: fixed = blocks of k tokens (ConceptLM), or a registered "
        "name / package.module:Class (docs/architecture.md).")
    coupling: str = _f(
        "add", "How the decoder uses the concepts: add = the prediction added, causally shifted, to the decoder "
        "input (ConceptLM), or a registered name / package.module:Class.")
    k: int = _f(4, "Tokens per concept block (segmentation: fixed).")
    encoder_layers: int = _f(1, "E: token layers before pooling (0 pools the embeddings, the GPT-2 variant).")
    concept_layers: int = _f(2, "C: causal layers of the concept transformer, run on T/k positions.")
    segments: int | None = _f(None, "S: product-quantisation segments (must divide d_model); null = n_heads.")
    codes: int = _f(64, "N: codes per segment (ConceptLM 64, NCP-ArchPreview 128).")
    codebook: Literal["simvq", "learned"] = _f(
        "simvq", "simvq = frozen Gaussian codes through a trained MLP transform; learned = plain trained codes.")
    code_weights: Literal["linear", "softmax"] = _f(
        "linear", "linear = raw head outputs weight the codes (ConceptLM); softmax = per segment (NCP-ArchPreview).")
    add: Literal["raw", "normed", "final_norm"] = _f(
        "raw", "raw = h + pred; normed = norm(h) + norm(pred) with norms of their own, the zero slots before the "
        "first concept left 0 (GPT-2 variant); final_norm = the model's final norm on both, the zero slots included "
        "(they become its bias: the authors' GPT-2 code).")
    detach_added_concept: bool = _f(False, "Stop next-token gradients at the added prediction (ConceptLM Llama variant).")
    ncp_reduction: Literal["mean", "sum_dim", "sum_segment"] = _f(
        "mean", "NCP loss ||pred_m - sg(c_m)||^2 over predicted blocks m: mean = mean over all elements "
        "(ConceptLM); sum_dim = sum over d, mean over blocks (NCP-ArchPreview Eq. 22); sum_segment = sum over "
        "each segment's d/S elements, mean over segments and blocks, i.e. sum_dim / S (NCP-ArchPreview "
        "Algorithm 1, line 21).")
    vq_reduction: Literal["mean", "sum_segment"] = _f(
        "mean", "VQ loss ||sg(c) - q||^2 over blocks: mean = mean over all elements (ConceptLM's MSE); "
        "sum_segment = sum over each segment's d/S elements, mean over segments and blocks (NCP-ArchPreview "
        "Eq. 21), i.e. d/S times mean. The commitment term (concept.commitment) is reduced alike.")
    ncp_weight: float = _f(1.0, "alpha: weight of the next-concept MSE loss.")
    vq_weight: float = _f(1.0, "beta_vq: weight of the codebook loss.")
    commitment: float = _f(
        0.25, "Weight of the commitment term ||c - sg(q)||^2, logged apart from vq_loss as commitment_loss and "
        "added to the total loss with vq_weight. c is detached at the VQ input, so the term is commitment x the "
        "codebook distance and has no gradient (NCP-ArchPreview Eq. 21 has no such term: 0).")
    rope_scale_by_k: bool = _f(False, "Concept transformer RoPE positions j -> j*k (token-aligned).")
    d_concept: int | None = _f(
        None, "Width of the concept transformer (DLCM Sec. 3.3.2: d_concept 3072 over d_token 1536); null = "
        "d_model. Wider: the pooled concepts are up-projected (W_up) and the heads read the wide states.")
    concept_heads: int | None = _f(
        None, "Attention heads of the concept transformer; null = d_concept / the token layers' head size "
        "(DLCM: 48 heads at 3072).")
    ffn_dim: int | None = _f(
        None, "MLP width of the concept transformer; null = model.ffn_dim when the concept transformer has the "
        "token layers' width and heads, else the backbone's rule at d_concept (4 d_concept, or 8/3 d_concept "
        "rounded to 256 for llama). DLCM gives no value.")
    copy_concept_layers_from_base: bool = _f(
        False, "HF import: initialise the concept layers from the base's first C layers (else fresh).")


@dataclass
class ModelConfig(*sections("model")):  # the built-in designs' sections (their DesignSpecs), in order
    """One NCP model. With ``concept.enabled`` false it is exactly the HF backbone. A design's own
    keys are its section, a base class here (config_residual.py, config_mtp.py, config_mup.py,
    config_bottleneck.py); a registered design's are under ``options``."""

    name: str = _f("custom", "Name recorded in checkpoints (default: the size).")
    backbone: str = _f("neox", "The backbone family: neox (Pythia: LayerNorm, parallel residual, partial rotary, "
                               "GELU), llama (RMSNorm, SwiGLU, RoPE, GQA) or gpt2 (LayerNorm, learned absolute "
                               "positions, tanh GELU, biases, HF's GPT2LMHeadModel); or a registered family / "
                               "package.module:Class (docs/architecture.md).")
    vocab_size: int = _f(50304, "Real vocabulary (default: the tokenizer's); the embedding holds padded_vocab_size.")
    pad_vocab_multiple: int = _f(128, "Pad the embedding/LM head rows to a multiple of this.")
    d_model: int = _f(768, "Hidden size d.")
    n_layers: int = _f(12, "Backbone token layers (E + D; PM adds extra_token_layers).")
    n_heads: int = _f(12, "Attention heads.")
    n_kv_heads: int | None = _f(None, "Key/value heads for GQA; null = n_heads.")
    ffn_dim: int | None = _f(None, "MLP width; null = 4*d (neox, gpt2) or 8/3*d rounded to 256 (llama).")
    max_seq_len: int = _f(2048, "Longest sequence the model is built for (gpt2: rows of the position embedding).")
    rotary_pct: float | None = _f(None, "Fraction of head dims with rotary; null = 0.25 (neox) / 1.0 (llama) / "
                                        "0 (gpt2: no rotary, learned absolute positions).")
    rope_base: float = _f(10000.0, "RoPE base (theta).")
    rope_scaling: dict | None = _f(
        None, "RoPE frequency scaling as HF's rope_parameters: {rope_type: llama3, factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings} (Llama-3.1); null = none.")
    norm_eps: float = _f(1e-5, "Epsilon of LayerNorm/RMSNorm.")
    parallel_residual: bool | None = _f(None, "GPT-NeoX parallel attention+MLP residual; null = true for neox.")
    bias: bool | None = _f(None, "Biases in linear layers; null = true for neox, false for llama.")
    tie_embeddings: bool = _f(False, "Share the token embedding with the LM head.")
    qk_norm: Literal["none", "layer", "head"] = _f(
        "none", "RMSNorm on queries/keys: over the whole projection (layer, OLMo-2) or per head (head, Qwen3).")
    clip_qkv: float | None = _f(
        None, "Clamp the fused query/key/value projection to [-clip_qkv, clip_qkv] before QK-norm and RoPE "
        "(OLMo-1's and Steerling-8B's stabiliser: 10); null = no clamp. No native HF export model has it "
        "with the other keys: such a base model does not export natively.")
    norm_placement: Literal["pre", "post"] = _f(
        "pre", "Where each block's norms sit: pre = on the sub-layer inputs, x + f(norm(x)); post = on its outputs "
        "before the residual add, x + norm(f(x)) (OLMo-2's reordered norm, kept by OLMo-3, on which NCP-ArchPreview "
        "Sec. 3 builds; the report does not state its placement). HF: post = Olmo2/Olmo3 (llama, qk_norm: layer).")
    sliding_window: int | None = _f(None, "Sliding-window attention width; null = full attention everywhere.")
    full_attn_every: int = _f(1, "With a sliding window: every n-th layer (n, 2n, ...) attends fully.")
    init_std: float = _f(0.02, "Std of the normal init of matrices and embeddings (init: hf, gpt2).")
    init: Literal["hf", "gpt2", "gpt-neox"] = _f(
        "hf", "Weight init: hf = N(0, init_std) everywhere; gpt2 = GPT-2's (HF GPT2's _init_weights): N(0, init_std) "
        "with the residual output projections (attention out-proj, MLP down-proj) N(0, init_std/sqrt(2L)); gpt-neox "
        "= Pythia's (small_init N(0, sqrt(2/(5d))), wang_init N(0, 2/(L*sqrt(d))) on those projections). L = the "
        "token layers (n_layers + extra_token_layers), for the concept layers' projections too.")
    extra_token_layers: int = _f(0, "Extra token layers: 2 = the parameter-matched (PM) baseline.")
    extra_token_layers_at: int | None = _f(
        None, "Where the extra token layers go: before backbone layer i (0 = at the bottom); null = on top.")
    copy_extra_layers_from_base: bool = _f(
        False, "HF import: initialise the extra token layers from the base's first extra_token_layers layers "
        "(ConceptLM 8B's PM baseline); else fresh.")
    residual: str = _f(
        "plain", "How each stack's layer outputs become the next layer's input: plain = x + f(x); irc = "
        "NCP-ArchPreview's intra-module residual (Sec. 2.6, Eqs. 14-18: unnormalised per-token weights over "
        "all earlier depths, starting as plain); block_attnres = Block Attention Residuals (Kimi Team 2026, "
        "arXiv 2603.15031; NCP-ArchPreview Table 3's external baseline): each layer's input is a softmax over "
        "the stored states of completed blocks of attnres_block layers and the current partial block, with a "
        "learned pseudo-query per layer; or a registered depth mixer / package.module:Class.")
    objective: str = _f(
        "next_token", "What the model is trained to predict (inputs and targets from a data window, the "
        "attention pattern, the loss, scoring and generation): next_token = next-token prediction; "
        "causal_diffusion = Steerling's Causal Diffusion LM (block-causal attention, masked blocks, keys "
        "model.diffusion.*: block-wise sampling, its held-out ELBO, the export's remote code); or a "
        "registered objective / package.module:Class (docs/architecture.md).")
    concept: ConceptConfig = _f(ConceptConfig, "The concept path.")
    options: dict = _f(
        dict, "The recipe keys of registered designs that declare them (a class attribute `options`, "
        "docs/architecture.md): options.NAME.KEY for the design registered as NAME; the keys of the chosen designs "
        "are filled with their defaults.")

    # ---- derived (computed in __post_init__) ----
    padded_vocab_size: int = field(init=False)
    head_dim: int = field(init=False)
    rotary_dim: int = field(init=False)
    n_token_layers: int = field(init=False)
    encoder_layers: int = field(init=False)  # E (0 when the concept path is off)
    decoder_layers: int = field(init=False)  # D = n_token_layers - E
    n_segments: int = field(init=False)  # S
    segment_dim: int = field(init=False)  # d / S
    # token layers + C (d_concept / d)^2 / (tokens per concept): a concept layer's 12 T d^2 term of the
    # paper view (ConceptLM App. C) at its own width on T / k positions, in token layers
    block_equivalents: float = field(init=False)
    # attention window of each token layer (encoder then decoder) and each concept layer;
    # None = full attention. Layer n (1-based, in its stack) is full when n % full_attn_every == 0.
    token_windows: tuple = field(init=False)
    concept_windows: tuple = field(init=False)
    learned_positions: bool = field(init=False)  # gpt2: a (max_seq_len, d) position embedding, no RoPE
    extra_layers: tuple = field(init=False)  # token-layer indices of PM's extra layers
    # the concept transformer's block config (itself unless concept.d_concept / concept_heads differ)
    concept_cfg: "ModelConfig" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.concept, dict):
            self.concept = ConceptConfig(**self.concept)
        c = self.concept
        problems: list[tuple[str, str]] = []

        def need_pos(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append((name, f"must be a positive integer, got {value!r}"))

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "pad_vocab_multiple"):
            need_pos(name, getattr(self, name))
        if problems:  # the rest divides by these
            raise ConfigError(problems)
        problems += self._backbone_defaults()
        problems += self._check_shapes()
        self.padded_vocab_size = _round_up(self.vocab_size, self.pad_vocab_multiple)
        self.head_dim = self.d_model // self.n_heads
        # HF GPT-NeoX: rotary_ndims = int(head_size * rotary_pct)
        self.rotary_dim = int(self.head_dim * self.rotary_pct)
        if self.rotary_dim % 2:
            problems.append(("rotary_pct", f"gives an odd rotary dimension {self.rotary_dim}"))
        self.n_token_layers = self.n_layers + self.extra_token_layers
        at = self.n_layers if self.extra_token_layers_at is None else self.extra_token_layers_at
        self.extra_layers = tuple(range(at, at + self.extra_token_layers))

        self.n_segments = c.segments if c.segments is not None else self.n_heads
        self.segment_dim = self.d_model // self.n_segments if self.n_segments > 0 else 0
        if c.enabled:
            problems += self._check_concept()
        problems += self._check_designs()
        law = None
        if c.enabled and not problems:
            try:
                law = segmentation_law(c.segmentation)
            except ConfigError as e:
                problems.extend(("concept.segmentation", m) for _, m in e.problems)
        if law is not None and law.check is not None:
            problems.extend((f"concept.{k}", m) for k, m in law.check(c, self))
        if c.enabled:
            problems += self._check_concept_width()
        # the designs' own sections (config_*.py): the concept path's, then the model's
        problems += [(f"concept.{k}", m) for k, m in section_problems(c, self, law)]
        problems += section_problems(self, self, law)
        if problems:
            raise ConfigError(problems)
        self.concept_cfg = self._concept_stack_config()

        self.token_windows = tuple(self._window(n) for n in range(1, self.n_token_layers + 1))
        self.concept_windows = tuple(self._window(n) for n in range(1, c.concept_layers + 1)) if c.enabled else ()
        if c.enabled:
            self.encoder_layers = c.encoder_layers
            self.decoder_layers = self.n_token_layers - c.encoder_layers
            wide = (self.concept_cfg.d_model / self.d_model) ** 2  # a wider concept layer costs (d_c/d)^2 per position
            self.block_equivalents = self.n_token_layers + c.concept_layers * wide / law.tokens_per_concept(c)
        else:
            self.encoder_layers = 0
            self.decoder_layers = self.n_token_layers
            self.block_equivalents = float(self.n_token_layers)
        late = [(f"concept.{k}", m) for k, m in section_settle(c, self)] + section_settle(self, self)
        if late:
            raise ConfigError(late)

    def _check_concept(self) -> list[tuple[str, str]]:
        """The concept path's own keys (with ``concept.enabled``)."""
        c, problems = self.concept, []
        for name in ("k", "codes"):
            if not is_positive_int(getattr(c, name)):
                problems.append((f"concept.{name}", f"must be a positive integer, got {getattr(c, name)!r}"))
        if not isinstance(c.concept_layers, int) or c.concept_layers < 0:
            problems.append(("concept.concept_layers", f"must be >= 0, got {c.concept_layers!r}"))
        if not isinstance(c.encoder_layers, int) or not 0 <= c.encoder_layers <= self.n_token_layers:
            problems.append((
                "concept.encoder_layers",
                f"must be between 0 and the {self.n_token_layers} token layers, got {c.encoder_layers!r}",
            ))
        if self.n_segments <= 0 or self.d_model % self.n_segments:
            problems.append(("concept.segments", f"{self.n_segments} does not divide d_model={self.d_model}"))
        if isinstance(c.k, int) and c.k > self.max_seq_len:
            problems.append(("concept.k", f"{c.k} exceeds max_seq_len={self.max_seq_len}"))
        for name, allowed in (
            ("codebook", ("simvq", "learned")),
            ("code_weights", ("linear", "softmax")),
            ("add", ("raw", "normed", "final_norm")),
            ("ncp_reduction", ("mean", "sum_dim", "sum_segment")),
            ("vq_reduction", ("mean", "sum_segment")),
        ):
            if getattr(c, name) not in allowed:
                problems.append((f"concept.{name}", f"must be one of {', '.join(allowed)}, got {getattr(c, name)!r}"))
        return problems

    def designs(self) -> dict[str, tuple[str, Any]]:
        """The chosen strategy of each extension point, as ``kind -> (recipe key, name)`` (the
        segmentation and the coupling only with the concept path)."""
        out = {"residual": ("residual", self.residual), "objective": ("objective", self.objective)}
        if self.concept.enabled:
            out["segmentation"] = ("concept.segmentation", self.concept.segmentation)
            out["coupling"] = ("concept.coupling", self.concept.coupling)
        return out

    def _check_designs(self) -> list[tuple[str, str]]:
        """The chosen strategies exist (an import path is imported now, so errors come early), and
        ``options`` holds the keys of registered designs that declare them (``register``)."""
        problems = []
        for kind, (key, name) in self.designs().items():
            if not isinstance(name, str):
                problems.append((key, f"must be a name, got {name!r}"))
            elif name not in STRATEGIES[kind]:
                try:
                    strategy(kind, name)
                except ConfigError as e:
                    problems.extend((key, m) for _, m in e.problems)
        if problems:
            return problems
        return _check_options(self)

    def design_options(self, kind: str) -> Any:
        """The options (a dataclass instance) of the design chosen for extension point ``kind``;
        None if it declares none."""
        return self.options.get(self.designs()[kind][1])

    def _concept_width(self) -> tuple[int, int]:
        """(d_concept, concept heads) with the nulls resolved."""
        c = self.concept
        dc = self.d_model if c.d_concept is None else c.d_concept
        return dc, (dc // self.head_dim if c.concept_heads is None else c.concept_heads)

    def _check_concept_width(self) -> list[tuple[str, str]]:
        c, out = self.concept, []
        for name in ("d_concept", "concept_heads", "ffn_dim"):
            v = getattr(c, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                out.append((f"concept.{name}", f"must be a positive integer or null, got {v!r}"))
        if out:
            return out
        dc, hc = self._concept_width()
        group = self.n_heads // self.n_kv_heads
        if hc <= 0 or dc % hc:
            out.append(("concept.d_concept", f"{dc} is not divisible by the {hc} concept heads (concept.concept_heads)"))
        elif hc % group:
            out.append(("concept.concept_heads", f"{hc} is not a multiple of the {group} query heads per KV head"))
        if c.ffn_dim is not None and c.ffn_dim != self.ffn_dim and c.copy_concept_layers_from_base:
            out.append(("concept.copy_concept_layers_from_base", f"the base's layers have MLP width {self.ffn_dim}; "
                                                                 f"concept.ffn_dim is {c.ffn_dim}"))
        if (dc, hc) != (self.d_model, self.n_heads):
            if self.crc_connections:
                out.append(("crc_connections", "cross-module residuals add concept and token states: they need "
                                               "concept.d_concept = d_model and the token head count"))
            if c.copy_concept_layers_from_base:
                out.append(("concept.copy_concept_layers_from_base", "the base's layers have the token width; "
                                                                     "concept.d_concept differs"))
        return out

    def _concept_stack_config(self) -> "ModelConfig":
        """The concept transformer's block config: this one, or the same backbone at d_concept."""
        if not self.concept.enabled:
            return self
        dc, hc = self._concept_width()
        ffn = self.concept.ffn_dim
        if (dc, hc) == (self.d_model, self.n_heads) and ffn in (None, self.ffn_dim):
            return self
        return dataclasses.replace(
            self, name=f"{self.name}.concept", d_model=dc, n_heads=hc, n_kv_heads=hc // (self.n_heads // self.n_kv_heads),
            ffn_dim=ffn, n_layers=1, extra_token_layers=0, extra_token_layers_at=None, crc_connections=[],
            mtp_depth=None, mtp_weight_schedule=[], concept=ConceptConfig())

    def _backbone_defaults(self) -> list[tuple[str, str]]:
        """The backbone family's values of the keys left null (family.py); its own checks."""
        fam = family(self.backbone)  # ConfigError if unknown
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for key, value in fam.defaults(self).items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        self.learned_positions = fam.learned_positions
        return fam.check(self)

    def _check_shapes(self) -> list[tuple[str, str]]:
        problems = []
        if self.d_model % self.n_heads:
            problems.append(("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}"))
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            problems.append(("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}"))
        if self.learned_positions and self.rotary_pct != 0.0:
            problems.append(("rotary_pct", f"gpt2 has learned absolute positions, no rotary: must be 0, got {self.rotary_pct}"))
        elif not self.learned_positions and not 0.0 < self.rotary_pct <= 1.0:
            problems.append(("rotary_pct", f"must be in (0, 1], got {self.rotary_pct}"))
        if self.rope_scaling is not None:
            problems += _check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and self.sliding_window <= 0:
            problems.append(("sliding_window", f"must be positive, got {self.sliding_window}"))
        if self.full_attn_every <= 0:
            problems.append(("full_attn_every", f"must be positive, got {self.full_attn_every}"))
        if self.extra_token_layers < 0:
            problems.append(("extra_token_layers", f"must be >= 0, got {self.extra_token_layers}"))
        at = self.extra_token_layers_at
        if at is not None and (not isinstance(at, int) or not 0 <= at <= self.n_layers):
            problems.append(("extra_token_layers_at", f"must be between 0 and n_layers={self.n_layers}, got {at!r}"))
        if self.qk_norm not in ("none", "layer", "head"):
            problems.append(("qk_norm", f"must be none, layer or head, got {self.qk_norm!r}"))
        if self.clip_qkv is not None and (not isinstance(self.clip_qkv, (int, float)) or isinstance(self.clip_qkv, bool)
                                          or not self.clip_qkv > 0):
            problems.append(("clip_qkv", f"must be a number > 0 or null, got {self.clip_qkv!r}"))
        if self.norm_placement not in ("pre", "post"):
            problems.append(("norm_placement", f"must be pre or post, got {self.norm_placement!r}"))
        if self.init not in INIT_SCHEMES:  # init schemes, not families (gpt2 names both)
            problems.append(("init", f"must be {', '.join(INIT_SCHEMES[:-1])} or {INIT_SCHEMES[-1]}, got {self.init!r}"))
        return problems

    def _window(self, number: int) -> int | None:
        """Sliding window of the 1-based layer ``number`` in its stack; every n-th layer is full."""
        if self.sliding_window is None or number % self.full_attn_every == 0:
            return None
        return self.sliding_window

    def num_concepts(self, T: int) -> int:
        """Concepts a T-token sequence gives (the segmentation's law; 0 without the path)."""
        return segmentation_law(self.concept.segmentation).concepts(self.concept, T) if self.concept.enabled else 0

    def expected_concepts(self, T: int) -> int:
        """Concepts the cost model counts in T tokens: ``num_concepts`` for a fixed law, T / R at the
        target ratio for a data-dependent one (whose ``num_concepts`` is a cache bound)."""
        if not self.concept.enabled:
            return 0
        law = segmentation_law(self.concept.segmentation)
        return (law.expected_concepts or law.concepts)(self.concept, T)

    @property
    def law(self) -> SegmentationLaw | None:
        """The segmentation's law (None without the concept path)."""
        return segmentation_law(self.concept.segmentation) if self.concept.enabled else None

    @property
    def tokens_per_concept(self) -> float | None:
        """Mean segment length of the segmentation (k for fixed blocks); None without the path."""
        c = self.concept
        return segmentation_law(c.segmentation).tokens_per_concept(c) if c.enabled else None

    def special_tokens(self) -> dict[str, str]:
        """The special tokens the chosen designs need in the tokenizer: the key path of the model
        key that holds each one's id (e.g. ``diffusion.mask_id``) -> the token's text (sections'
        ``section_tokens``): ``ncpctl tokenize`` adds them, the recipe loader reads their ids."""
        return section_tokens(self, self)

    def seq_len_problems(self, seq_len: int) -> list[tuple[str, str]]:
        """Problems (recipe key, message) of windows of ``seq_len`` tokens for the chosen designs."""
        return section_seq_len(self, self, seq_len)

    # ---- (de)serialisation: checkpoints carry this dict (style rule 7) ----
    def to_dict(self) -> dict[str, Any]:
        """Init fields only (derived ones are recomputed on load)."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}
        out["options"] = {name: _plain(o) for name, o in self.options.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """The config of ``to_dict``'s dict; a section missing from an older checkpoint is off
        (its defaults), e.g. ``bottleneck`` and ``options``."""
        d = dict(d)
        d["concept"] = ConceptConfig(**d.get("concept", {}))
        return cls(**d)


def _plain(v: Any) -> Any:
    """A dataclass value (a section's config) as a dict; anything else as is."""
    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v


# Named sizes are data. Values not listed take the dataclass defaults.
SIZES: dict[str, dict[str, Any]] = {
    # Runs the whole pipeline on a laptop CPU in seconds. vocab_size is normally taken
    # from the recipe's tokenizer.
    "debug": dict(
        backbone="neox", vocab_size=2048, d_model=64, n_layers=4, n_heads=4, max_seq_len=256,
        concept=dict(k=4, encoder_layers=1, concept_layers=2, segments=4, codes=16),
    ),
    "llama-debug": dict(
        backbone="llama", vocab_size=2048, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
        ffn_dim=176, max_seq_len=256, norm_eps=1e-6, qk_norm="layer", sliding_window=32,
        full_attn_every=2,
        concept=dict(k=4, encoder_layers=1, concept_layers=2, segments=4, codes=16, code_weights="softmax"),
    ),
    # Pythia (GPT-NeoX): vocab 50277 padded to 50304; ConceptLM defaults E=1, C=2, N=64, S=n_heads.
    "pythia-70m": dict(backbone="neox", vocab_size=50304, d_model=512, n_layers=6, n_heads=8, max_seq_len=2048),
    "pythia-160m": dict(backbone="neox", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=2048),
    "pythia-410m": dict(backbone="neox", vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, max_seq_len=2048),
    # GPT-2 (HF GPT2LMHeadModel): vocab 50257 (padded to 50304 unless pad_vocab_multiple: 1), 1024
    # positions, tied embeddings; ConceptLM's main GPT-2 setting pools the input of block 0
    # (token + position embeddings, E = 0) and adds with norms (add: normed), paper Sec. 4 / App. E.1.
    **{name: dict(backbone="gpt2", vocab_size=50257, d_model=d, n_layers=L, n_heads=H, max_seq_len=1024,
                  tie_embeddings=True, concept=dict(encoder_layers=0, add="normed"))
       for name, d, L, H in (("gpt2-124m", 768, 12, 12), ("gpt2-355m", 1024, 24, 16),
                             ("gpt2-774m", 1280, 36, 20), ("gpt2-1.5b", 1600, 48, 25))},
    # Llama-3.1-8B (the ConceptLM paper's 8B continual pre-training base, Table 3).
    "llama3.1-8b": dict(
        backbone="llama", vocab_size=128256, pad_vocab_multiple=1, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=8, ffn_dim=14336, max_seq_len=131072, rope_base=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    # NCP-ArchPreview 8.94B: E/C/D = 16/8/16 (spec section 4). The report (Sec. 4.1, Table 10) gives
    # RMSNorm eps 1e-6 and OLMo's layer-wise QK-norm but not the norm placement (OLMo-3, its base and
    # baseline, is post-norm): pre until the released weights say otherwise. The codes are learned
    # directly (Sec. 2.3: S x N = 32 x 128 codes of d/S = 128 dims, 524,288 parameters; Sec. 5.1's
    # adapt-vq trains them), not made by SimVQ's transform. The losses are the report's: Eq. 21's VQ
    # (summed over a segment's d/S dims, mean over segments and blocks; no commitment term) and Eq.
    # 22's NCP (summed over d).
    "ncp-archpreview-8.9b": dict(
        backbone="llama", vocab_size=100278, d_model=4096, n_layers=32, n_heads=32, ffn_dim=11008,
        max_seq_len=8192, rope_base=500000.0, norm_eps=1e-6, qk_norm="layer", norm_placement="pre",
        sliding_window=4096, full_attn_every=4,
        concept=dict(
            enabled=True, k=4, encoder_layers=16, concept_layers=8, segments=32, codes=128, codebook="learned",
            code_weights="softmax", ncp_reduction="sum_dim", vq_reduction="sum_segment", commitment=0.0,
        ),
    ),
    # DLCM 2.3B (Table 3): d_token 1536 (24 heads), a concept transformer at d_concept 3072 (48
    # heads), E/C/D = 10/16/6, vocab 128,815 (DeepSeek-V3's tokenizer), 8k positions, learned
    # boundaries at R = 4 with the Global Parser, one causal cross-attention, L_CE + lambda L_aux.
    # LLaMA blocks (the paper follows LLaMA): SwiGLU at 8/3 d, RoPE base 10000, RMSNorm eps 1e-6.
    "dlcm-2.3b": dict(
        backbone="llama", vocab_size=128815, d_model=1536, n_layers=16, n_heads=24, max_seq_len=8192,
        norm_eps=1e-6,
        concept=dict(
            enabled=True, segmentation="dynamic", coupling="cross_attention", encoder_layers=10,
            concept_layers=16, d_concept=3072, concept_heads=48, target_ratio=4, balance="global",
            ncp_weight=0.0, vq_weight=0.0,
        ),
    ),
}


def deep_merge(base: dict[str, Any], over: dict[str, Any],
               on_leaf: Callable[[tuple[Any, ...], Any], None] | None = None) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: where both hold a dict the two merge key by key,
    anywhere else the value from ``over`` wins. The one deep merge of ncpctl (named sizes +
    overrides, a recipe + what it ``extends``, the DeepSpeed config + ``deepspeed.extra``).

    The result shares no mutable value with either input (everything is deep-copied), so a
    caller may change it without touching ``SIZES``, a parent recipe or the recipe's
    ``deepspeed.extra``. ``on_leaf(key_path, value)`` is called for every value taken from
    ``over`` (a dict that replaces a non-dict counts as one value), with the key path as a
    tuple: the recipe loader records there which file set each key. Stdlib only, like the
    rest of this module: exported Hugging Face directories are to carry a verbatim copy.
    """
    import copy

    def merge_into(out: dict[str, Any], src: dict[str, Any], path: tuple[Any, ...]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                merge_into(out[k], v, (*path, k))
            else:
                out[k] = copy.deepcopy(v)
                if on_leaf is not None:
                    on_leaf((*path, k), out[k])

    merged = copy.deepcopy(base)
    merge_into(merged, over, ())
    return merged


def build_config(size: str, **overrides: Any) -> ModelConfig:
    """The named ``size`` with ``overrides`` (nested dicts for ``concept``, ``bottleneck``) applied."""
    if size not in SIZES:
        raise ConfigError([("size", f"unknown size {size!r}; known: {', '.join(SIZES)}")])
    merged = deep_merge(SIZES[size], {k: v for k, v in overrides.items() if v is not None})
    merged.setdefault("name", size)
    return ModelConfig.from_dict(merged)
