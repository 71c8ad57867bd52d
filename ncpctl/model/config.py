"""`ModelConfig`: the one typed description of an NCP model (shared/docs/ncp-model.md).

Pure Python (no torch import) so recipes can be validated before any heavy import.
Derived numbers (head size, padded vocab, FFN width, segment width, encoder/decoder split,
block-equivalent count) are computed once in ``__post_init__``; nothing else recomputes
them. Every way a config can be impossible is collected as ``(field, message)`` pairs and
raised together as ``ConfigError`` so the recipe layer can report all of them at once.

Named sizes are data (``SIZES``); ``build_config(size, **overrides)`` merges them.

Extension points (segmentation, coupling, residual) are named here so that a recipe can be
validated without torch: ``STRATEGIES`` holds the names the model knows (built-ins, plus
whatever ``ncpctl.model.registry`` registers at run time); a name of the form
``package.module:Class`` is imported when the config is built, except inside
``from_checkpoint(...)`` (a config read from a checkpoint): there only import paths the user
named too (a recipe, ``--strategy``, code: ``trust``) are imported, so that opening a checkpoint
never imports a module it names (issue 21). A segmentation also declares
its ``SegmentationLaw`` (how many concepts a T-token sequence gives): accounting, cache sizes
and the export probe ask it instead of assuming a fixed k.

This module and the rest of ``ncpctl/model/`` (but ``hf.py`` and ``accounting.py``) are copied
verbatim into exported Hugging Face directories: they import nothing from ``ncpctl``, only each
other, with relative imports.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

ROPE_TYPES = ("llama3",)  # rope_scaling types rope() implements (HF's names)


@dataclass(frozen=True)
class SegmentationLaw:
    """What the rest of ncpctl may know of a segmentation without running it (torch-free).

    ``concepts(c, T)``: concepts a T-token sequence gives (an upper bound for data-dependent
    segmentations: it sizes caches); ``tokens_per_concept(c)``: the mean segment length, for
    the cost model (a concept layer runs on T / tokens_per_concept positions)."""

    concepts: Callable[["ConceptConfig", int], int]
    tokens_per_concept: Callable[["ConceptConfig"], float]
    length_key: str | None = None  # the concept.* key that sets the segment length (for errors)
    # pooling depends on positions only (not on the states): any tensor, e.g. every encoder depth
    # for the encoder-concept cross-module residual, can be pooled by the same segments
    pools_any_width: bool = False
    # the segmentation's own recipe checks: (concept config, model config) -> [(concept key, message)]
    check: Callable[["ConceptConfig", "ModelConfig"], list] | None = None
    # data-dependent segmentations: the concepts the cost model counts in T tokens (None: ``concepts``)
    expected_concepts: Callable[["ConceptConfig", int], int] | None = None


# Fixed blocks of k tokens (ConceptLM): a trailing partial block is not pooled.
FIXED_BLOCKS = SegmentationLaw(concepts=lambda c, T: T // c.k, tokens_per_concept=lambda c: float(c.k),
                               length_key="k", pools_any_width=True)
BOUNDARY_MODES = ("predictor", "boundary")
BALANCES = ("global", "sequence")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_dynamic(c: "ConceptConfig", cfg: "ModelConfig") -> list[tuple[str, str]]:
    """The keys of ``segmentation: dynamic`` (DLCM Sec. 3.3, 8.1)."""
    out = []
    if c.boundary_mode not in BOUNDARY_MODES:
        out.append(("boundary_mode", f"must be one of {', '.join(BOUNDARY_MODES)}, got {c.boundary_mode!r}"))
    if not _is_number(c.target_ratio) or c.target_ratio <= 1:
        out.append(("target_ratio",
                    f"R must be a number > 1 (the target boundary rate is 1/R), got {c.target_ratio!r}"))
    if c.balance not in BALANCES:
        out.append(("balance", f"must be one of {', '.join(BALANCES)}, got {c.balance!r}"))
    if not _is_number(c.balance_weight) or c.balance_weight < 0:
        out.append(("balance_weight", f"must be a number >= 0, got {c.balance_weight!r}"))
    if not _is_number(c.boundary_temperature) or c.boundary_temperature <= 0:
        out.append(("boundary_temperature", f"must be a number > 0, got {c.boundary_temperature!r}"))
    if not _is_number(c.boundary_threshold) or not 0 < c.boundary_threshold < 1:
        out.append(("boundary_threshold", f"must be in (0, 1), got {c.boundary_threshold!r}"))
    if c.boundary_mode == "boundary":
        if c.boundary_tau is None:
            out.append(("boundary_tau", "boundary_mode: boundary compares (1 - cos(h[t-1], h[t]))/2 against tau; "
                                        "none given"))
        elif not _is_number(c.boundary_tau) or not 0 < c.boundary_tau < 1:
            out.append(("boundary_tau", f"must be in (0, 1), got {c.boundary_tau!r}"))
    return out


# Data-dependent boundaries (DLCM): at most T - 1 segments close within T tokens (the last one is
# still open); the cost model counts int(T / R) concepts at the target ratio R (not T // R, which
# is 79.0 for 256 // 3.2).
DYNAMIC = SegmentationLaw(concepts=lambda c, T: max(T - 1, 0), tokens_per_concept=lambda c: float(c.target_ratio),
                          check=_check_dynamic, expected_concepts=lambda c, T: int(T / c.target_ratio))
CRC_CONNECTIONS = ("encoder-concept", "encoder-decoder", "concept-decoder")
CRC_MODES = ("layers", "input")

# Names of the extension points' strategies: name -> a class, a "module:attr" import path
# (relative paths are resolved in this package) or, for segmentations, also its law.
STRATEGIES: dict[str, dict[str, Any]] = {
    "segmentation": {"fixed": ".segment:FixedBlocks", "dynamic": ".dynamic:DynamicSegmenter"},
    "coupling": {"add": ".coupling:AddCoupling", "cross_attention": ".coupling:CrossAttentionCoupling"},
    "residual": {"plain": ".layers:PlainResidual", "irc": ".residual:IRC", "block_attnres": ".residual:BlockAttnRes"},
    "objective": {"next_token": ".objective:NextToken"},
    # backbone families (family.py): one module each
    "backbone": {"neox": ".family_neox:NeoX", "llama": ".family_llama:Llama", "gpt2": ".family_gpt2:GPT2"},
}
LAWS: dict[str, SegmentationLaw] = {"fixed": FIXED_BLOCKS, "dynamic": DYNAMIC}


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


def register(kind: str, name: str, cls: Any = None) -> Any:
    """Make ``cls`` the strategy ``name`` of extension point ``kind`` (``segmentation``,
    ``coupling``, ``residual``, ``objective`` or ``backbone``: a ``Family``, family.py); then
    ``model.concept.segmentation: name`` (etc.) selects it.
    A segmentation class must declare its ``law`` (a ``SegmentationLaw``). Usable as a class
    decorator: ``@register("segmentation", "mine")``. Returns ``cls``."""
    if kind not in STRATEGIES:
        raise ValueError(f"unknown extension point {kind!r}; known: {', '.join(STRATEGIES)}")

    def add(c: Any) -> Any:
        if kind == "segmentation":
            law = getattr(c, "law", None)
            if not isinstance(law, SegmentationLaw):
                raise TypeError(f"{c!r}: a segmentation declares its SegmentationLaw as the class attribute `law`")
            LAWS[name] = law
        STRATEGIES[kind][name] = c
        return c

    return add if cls is None else add(cls)


# import paths (package.module:Class) the user named: a recipe, --strategy, a config built in code
_TRUSTED: set[str] = set()
UNTRUSTED = "is named only by the checkpoint"  # the refusal's words (the recipe loader looks for them)
# the checkpoint whose config is being read (from_checkpoint), None elsewhere
_CHECKPOINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ncpctl_checkpoint", default=None)


def trust(*targets: str) -> None:
    """Let configs read from checkpoints import these strategies (``package.module:Class``), as
    when the user names them (``--strategy``)."""
    _TRUSTED.update(targets)


@contextlib.contextmanager
def from_checkpoint(where: Any) -> Any:
    """Within: configs are read from checkpoint ``where``, whose strategy import paths are
    imported only if the user named them too (``trust``); others are a ``ConfigError``."""
    token = _CHECKPOINT.set(str(where))
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def strategy(kind: str, name: str) -> Any:
    """The class registered as ``name`` for extension point ``kind``, importing it if named by
    an import path (``package.module:Class``). Raises ``ConfigError`` for an unknown name, and
    for an import path that only a checkpoint names (``from_checkpoint``)."""
    import importlib

    target = STRATEGIES[kind].get(name, name if ":" in name else None)
    if target is None:
        known = ", ".join(sorted(STRATEGIES[kind]))
        raise ConfigError([(kind, f"unknown {kind} {name!r}; known: {known} (or package.module:Class)")])
    if not isinstance(target, str):
        return target
    if name not in STRATEGIES[kind]:  # an import path the user or a checkpoint gave
        where = _CHECKPOINT.get()
        if where is None:
            _TRUSTED.add(name)
        elif name not in _TRUSTED:
            raise ConfigError([(kind, f"{name!r} {UNTRUSTED} {where}, and ncpctl does not "
                                      f"import code a checkpoint names; if you trust it, name it yourself: "
                                      f"--strategy {name} (or in a recipe)")])
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module, package=__package__) if module.startswith(".") else \
            importlib.import_module(module)
        return getattr(mod, attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError([(kind, f"cannot import {target!r} ({e})")]) from None


def segmentation_law(name: str) -> SegmentationLaw:
    """The law of segmentation ``name`` (a class named by import path declares it as ``law``)."""
    if name not in LAWS:
        law = getattr(strategy("segmentation", name), "law", None)
        if not isinstance(law, SegmentationLaw):
            raise ConfigError([("segmentation", f"{name!r} declares no SegmentationLaw (a class attribute `law`)")])
        LAWS[name] = law
    return LAWS[name]


class ConfigError(ValueError):
    """Impossible model configuration; ``problems`` is a list of (field path, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation (the recipe schema and reference read it)."""
    if isinstance(default, type):
        return field(default_factory=default, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ConceptConfig:
    """The concept path (spec sections 1-3). Defaults follow ConceptLM (Pythia)."""

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
    add: Literal["raw", "normed"] = _f("raw", "raw = h + pred; normed = norm(h) + norm(pred) (GPT-2 variant).")
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
    boundary_mode: Literal["predictor", "boundary"] = _f(
        "predictor", "segmentation: dynamic. predictor = DLCM Sec. 3.3.1: p_t = (1 - cos(W_q h[t-1], W_k h[t]))/2, "
        "W_q = W_k = I at init, p_0 = 1, trained by the balance loss only; boundary = Sec. 8.1's rule: a boundary "
        "where (1 - cos(h[t-1], h[t]))/2 >= boundary_tau (no parameters, the same in training and inference).")
    boundary_temperature: float = _f(
        0.1, "predictor, training: boundaries are Bernoulli(sigmoid(logit(p)/temperature)); < 1 sharpens p away "
        "from 0.5 toward the inference rule p >= 0.5 (temperature -> 0), 1 = Bernoulli(p). The paper names a "
        "temperature but no value; 0.1 keeps the inference rate near the trained one (debug-dlcm, 200 steps: "
        "validation tokens per concept 4.2-4.3 at R = 4, against 6.1 with 0.5).")
    boundary_threshold: float = _f(0.5, "predictor, inference: b_t = [p_t >= threshold] (DLCM: 0.5).")
    boundary_tau: float | None = _f(
        None, "boundary mode: the threshold tau on (1 - cos(h[t-1], h[t]))/2; required there.")
    boundary_grad_to_encoder: bool = _f(
        False, "predictor: let the balance loss's gradient reach the encoder through h (false: W_q and W_k see "
        "h detached, so only they learn from it). The LM loss never reaches W_q, W_k.")
    target_ratio: float = _f(4.0, "R: target tokens per concept of segmentation: dynamic (DLCM: 4); boundary rate 1/R.")
    balance: Literal["global", "sequence"] = _f(
        "global", "Load balance L_aux (DLCM Eq. 10) over: global = the global batch (the Global Parser; F is the "
        "previous optimizer step's global boundary rate, G the batch mean of p); sequence = each sequence's own "
        "F and G, averaged (Table 4's Normal).")
    balance_weight: float = _f(
        0.03, "lambda: weight of L_aux in the loss (the DLCM notes give none; 0.03 is H-Net's ratio-loss weight).")
    cross_attention: Literal["per_concept", "replicated"] = _f(
        "per_concept", "coupling: cross_attention: which function the token-to-concept attention is (ncp-model.md "
        "section 8). per_concept = DLCM Eq. 14: a softmax over the closed concepts, each once; replicated = DLCM "
        "Sec. 4.1's kernel taken as the function: each concept's key/value copied onto the tokens of the next "
        "segment under a causal mask, so a concept weighs by its visible copies. The recipe chooses the function, "
        "the same on every machine; the device only picks the kernel that computes it (per_concept: SDPA with a "
        "(T, M) boolean mask, a fused masked kernel on a GPU; replicated: one is_causal SDPA, flash on a GPU).")
    copy_concept_layers_from_base: bool = _f(
        False, "HF import: initialise the concept layers from the base's first C layers (else fresh).")


BOTTLENECK_INDEPENDENCE = ("known_unknown", "known_unknown_residual")


@dataclass
class BottleneckConfig:
    """Steerling's additive concept bottleneck (bottleneck.py): between the final norm and the LM
    head, h = k K + u (A B) + e, with n labelled (known) concepts and m unknown ones. Defaults are
    Steerling-8B's pre-training values (shared/papers/004: chunk 64, m = 3n, rank 256, dropout 0.1,
    teacher forcing 1 -> 0.5); where the paper gives no number the choice is said."""

    enabled: bool = _f(False, "Turn the concept bottleneck on (Steerling); off = the LM head reads h directly.")
    concepts: int | None = _f(None, "n: labelled (known) concepts, the width of the labels (required when enabled).")
    unknown: int | None = _f(None, "m: unknown concepts; null = 3n (Steerling: m = 3n).")
    rank: int | None = _f(
        None, "r: rank of the unknown embedding U = A B (A: (m, r), B: (r, d)); null = Steerling's 256, capped to "
        "d_model and m (an explicit value above either is an error).")
    chunk: int = _f(64, "Tokens per label chunk: the concept loss ORs a chunk's tokens, chunks start at position 0 "
                        "(Steerling: 64, its diffusion block).")
    dropout: float = _f(0.1, "Dropout on the residual e in training only, so the concepts must carry the signal "
                             "(Steerling: 0.1 pre-training, 0.3 mid-training).")
    concept_weight: float = _f(1.0, "Weight of the chunk-level concept BCE (the paper gives no value: 1).")
    reconstruction_weight: float = _f(
        1.0, "Weight of the reconstruction loss: mean squared error of u U toward h - k_true K (the paper gives "
        "no value: 1).")
    independence_weight: float = _f(
        1.0, "Weight of the linear cross-covariance independence penalty (the paper gives no value: 1).")
    independence: Literal["known_unknown", "known_unknown_residual"] = _f(
        "known_unknown", "Independence penalty between kK and uU (pre-training); known_unknown_residual adds uU vs "
        "e (Steerling's mid-training variant).")
    teacher_forcing_start: float = _f(
        1.0, "Teacher-forcing probability at step 0: a chunk's known concepts replaced by the labels of the chunk "
        "before it, the last that closed (Steerling: annealed from 1; never the labels of t's own chunk or later; "
        "refused on document-level labels).")
    teacher_forcing_end: float = _f(
        0.5, "Teacher-forcing probability after teacher_forcing_steps (Steerling: 0.5 pre-training, 0 mid-training).")
    teacher_forcing_steps: int = _f(
        1000, "Optimizer steps of the linear anneal start -> end (the paper does not give its length).")
    unknown_head: Literal["dense", "low_rank"] = _f(
        "dense", "g, the unknown head's predictor: dense = Linear(d, m); low_rank = Linear(d, r) then Linear(r, m) "
        "with the rank r of U (Steerling's released code factorises it so; at 8B it cuts the module's parameters "
        "about in half).")
    top_k_known: int | None = _f(None, "Keep the top-k known activations per token; null = dense (Steerling "
                                       "mid-training: 32).")
    top_k_unknown: int | None = _f(None, "Keep the top-k unknown activations per token; null = dense (Steerling "
                                         "mid-training: 128).")
    # Steerling's steering stages (mid-training, 4 x 90 steps): inject a labelled concept's direction
    # where the labels say the text carries it, and teach the model to respond (bottleneck.py)
    respond_weight: float = _f(
        0.0, "Steering stage: weight of L_respond = -mean log k_c at the positions where concept c's direction "
        "was injected (Steerling; 0 = no steering stage). With express_weight > 0 too, training injects.")
    express_weight: float = _f(
        0.0, "Steering stage: weight of L_express = -mean log sum_{y in T_c} p(y) at the injected positions, T_c "
        "the concept's lift tokens (the tokens most over-represented in its labelled spans of the train split).")
    steer_at: str = _f(
        "readout", "Steering stage: where the direction is added in training: readout (the bottleneck's output, "
        "what the LM head reads: Steerling's concept intervention, raising k_c), decoder_input, encoder.L or "
        "decoder.L (after layer L of that stack); generate --steer's at= names these sites the same way. "
        "readout is the default because it is where steering worked at the debug size (bench/steering.py).")
    steer_strength: float = _f(
        2.0, "Steering stage: the injection's strength in nominal logit units, gamma = strength / peak(W_lm e_c) "
        "over the real vocabulary, as generate --steer ...,strength=S logit defines it (Steerling's tau / peak(e_c), "
        "whose value the paper does not give).")
    steer_fraction: float = _f(
        0.5, "Steering stage: the probability that a training row is injected (with one of the concepts its "
        "labels carry, drawn uniformly); the other rows train as plain language modelling.")
    lift_tokens: int = _f(16, "Steering stage: |T_c|, lift tokens per concept for L_express.")


# ``concept.cross_attention: auto`` took the faster form of the machine where a run started, so one
# recipe trained different functions on a laptop and on a cluster. It resolved where the config was
# made, so no checkpoint or resolved recipe holds it: only a hand-written recipe can.
_NO_AUTO = ("auto is no longer a value: per_concept (DLCM Eq. 14, the default) and replicated (Sec. 4.1) are "
            "different functions, so the recipe names one (a checkpoint made with auto recorded the one it was "
            "trained as: its recipe.resolved.yaml)")


def steer_site(at: Any) -> tuple[str, int | None] | None:
    """``decoder_input`` / ``readout`` -> (that, None); ``encoder.L`` / ``decoder.L`` -> (stack, L); None if neither."""
    if at in ("decoder_input", "readout"):
        return at, None
    stack, _, layer = str(at).partition(".")
    if stack in ("encoder", "decoder") and layer.lstrip("-").isdigit():
        return stack, int(layer)
    return None


def _check_bottleneck(b: BottleneckConfig, d: int) -> tuple[list[tuple[str, str]], int, int]:
    """Problems of ``model.bottleneck`` and the derived (m, r); (0, 0) when it is off or broken."""
    if not isinstance(b.enabled, bool):
        return [("bottleneck.enabled", f"must be true or false, got {b.enabled!r}")], 0, 0
    if not b.enabled:
        return [], 0, 0
    problems: list[tuple[str, str]] = []

    def pos_int(key: str, v: Any, required: bool = False) -> bool:
        if v is None and not required:
            return False
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            why = "is required when bottleneck.enabled (the number of labelled concepts)" if v is None else \
                f"must be a positive integer, got {v!r}"
            problems.append((f"bottleneck.{key}", why))
            return False
        return True

    n_ok = pos_int("concepts", b.concepts, required=True)
    pos_int("unknown", b.unknown)
    pos_int("chunk", b.chunk, required=True)
    for key in ("top_k_known", "top_k_unknown", "rank"):
        pos_int(key, getattr(b, key))
    steps = b.teacher_forcing_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        problems.append(("bottleneck.teacher_forcing_steps", f"must be an integer >= 0, got {steps!r}"))
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if not num(b.dropout) or not 0 <= b.dropout < 1:
        problems.append(("bottleneck.dropout", f"must be in [0, 1), got {b.dropout!r}"))
    for key in ("teacher_forcing_start", "teacher_forcing_end"):
        if not num(getattr(b, key)) or not 0 <= getattr(b, key) <= 1:
            problems.append((f"bottleneck.{key}", f"a probability in [0, 1] is required, got {getattr(b, key)!r}"))
    for key in ("concept_weight", "reconstruction_weight", "independence_weight"):
        if not num(getattr(b, key)) or getattr(b, key) < 0:
            problems.append((f"bottleneck.{key}", f"must be a number >= 0, got {getattr(b, key)!r}"))
    for key in ("respond_weight", "express_weight", "steer_strength"):
        if not num(getattr(b, key)) or getattr(b, key) < 0:
            problems.append((f"bottleneck.{key}", f"must be a number >= 0, got {getattr(b, key)!r}"))
    if not num(b.steer_fraction) or not 0 < b.steer_fraction <= 1:
        problems.append(("bottleneck.steer_fraction", f"a probability in (0, 1] is required, got {b.steer_fraction!r}"))
    pos_int("lift_tokens", b.lift_tokens, required=True)
    if steer_site(b.steer_at) is None:
        problems.append(("bottleneck.steer_at", f"must be decoder_input, readout, encoder.L or decoder.L, "
                                                f"got {b.steer_at!r}"))
    if b.unknown_head not in ("dense", "low_rank"):
        problems.append(("bottleneck.unknown_head", f"must be dense or low_rank, got {b.unknown_head!r}"))
    if b.independence not in BOTTLENECK_INDEPENDENCE:
        problems.append(("bottleneck.independence", f"must be one of {', '.join(BOTTLENECK_INDEPENDENCE)}, "
                                                    f"got {b.independence!r}"))
    rank_ok = isinstance(b.rank, int) and not isinstance(b.rank, bool) and b.rank > 0
    if rank_ok and b.rank > d:
        problems.append(("bottleneck.rank", f"{b.rank} exceeds d_model={d}: U = A B would not be low-rank"))
    if problems or not n_ok:
        return problems, 0, 0
    m = b.unknown if b.unknown is not None else 3 * b.concepts
    r = b.rank if b.rank is not None else min(256, d, m)
    if r > m:
        problems.append(("bottleneck.rank", f"{r} exceeds the {m} unknown concepts"))
    if b.top_k_known is not None and b.top_k_known > b.concepts:
        problems.append(("bottleneck.top_k_known", f"{b.top_k_known} exceeds the {b.concepts} known concepts"))
    if b.top_k_unknown is not None and b.top_k_unknown > m:
        problems.append(("bottleneck.top_k_unknown", f"{b.top_k_unknown} exceeds the {m} unknown concepts"))
    return problems, (0 if problems else m), (0 if problems else r)


@dataclass
class ModelConfig:
    """One NCP model. With ``concept.enabled`` false it is exactly the HF backbone."""

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
        "attention pattern, the loss, scoring and generation): next_token = next-token prediction; or a "
        "registered objective / package.module:Class (docs/architecture.md).")
    irc_hidden: int = _f(32, "IRC: hidden width of each layer's weight MLP (the paper does not state it).")
    irc_normalize: Literal["none", "softmax"] = _f(
        "none", "IRC weights: none = unnormalised (the paper); softmax = Table 3's per-stage-softmax variant.")
    crc_connections: list = _f(
        list, "NCP-ArchPreview's cross-module residuals (Sec. 2.6, Eqs. 19-20), any of encoder-concept, "
        "encoder-decoder, concept-decoder (all three: the paper's IRC+CRC); needs the concept path.")
    crc_hidden: int = _f(32, "CRC: hidden width of each target layer's depth-selection MLP.")
    crc_init: float = _f(0.0, "CRC: initial per-dimension scale D (0: the network starts as the plain one; "
                              "the paper's small init, e.g. 0.01, as an option).")
    crc_mode: Literal["layers", "input"] = _f(
        "layers", "Where each CRC connection enters its target module: layers = after every target layer (Sec. 2.6, "
        "Eqs. 19-20); input = once, on the target module's input (Table 3's \"IRC + input-level cross connection\").")
    attnres_block: int = _f(4, "block_attnres: layers per block (Table 3: 4); a block's layer updates are summed "
                               "into one stored state.")
    attnres_cross: bool = _f(
        True, "block_attnres with the concept path: the block states continue across modules (encoder -> concept "
        "pooled like the concepts, encoder and concept -> decoder aligned and shifted like CRC): Table 3's arm.")
    mtp_depth: int | None = _f(
        None, "Multi-token prediction depths D (NCP-ArchPreview Sec. 5.2: 1, predicting t+2; ConceptLM Table 4's "
        "4-future-token baseline: 3, the main head predicting t+1); null = off. Training only: evaluation and export use the main head.")
    mtp_weight: float = _f(0.3, "Weight of the mean MTP depth loss in the total loss (ArchPreview, DeepSeek-V3: 0.3).")
    mtp_weight_schedule: list = _f(
        list, "[[from_step, weight], ...]: the MTP weight from each step on (DeepSeek-V3: 0.3, then 0.1).")
    mtp_stop_token: int | None = _f(
        None, "End-of-document token id: an MTP shift across it is not scored (null: shifts cross documents).")
    mup_base_width: int | None = _f(
        None, "Decoupled muP (DLCM Sec. 6.1): the base width d_base the hyperparameters were tuned at; null = off "
        "(standard parametrization). s_token = d_model / d_base: token-module hidden matrices get init variance "
        "and AdamW lr and epsilon / s_token, the logits are divided by s_token; embeddings, norms, biases and the "
        "LM head keep the base init and lr; which matrix is hidden: README, Decoupled muP.")
    mup_base_concept_width: int | None = _f(
        None, "Decoupled muP: the concept transformer's base width; s_concept = d_concept / it scales the concept "
        "module's hidden matrices the same way; null = mup_base_width.")
    concept: ConceptConfig = _f(ConceptConfig, "The concept path.")
    bottleneck: BottleneckConfig = _f(BottleneckConfig, "Steerling's additive concept bottleneck before the LM head.")

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
    bottleneck_unknown: int = field(init=False)  # m (0 without the bottleneck)
    bottleneck_rank: int = field(init=False)  # r of U = A B (0 without the bottleneck)
    # the concept transformer's block config (itself unless concept.d_concept / concept_heads differ)
    concept_cfg: "ModelConfig" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.concept, dict):
            self.concept = ConceptConfig(**self.concept)
        if isinstance(self.bottleneck, dict):
            self.bottleneck = BottleneckConfig(**self.bottleneck)
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
            need_pos("concept.k", c.k)
            need_pos("concept.codes", c.codes)
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
                ("add", ("raw", "normed")),
                ("ncp_reduction", ("mean", "sum_dim", "sum_segment")),
                ("vq_reduction", ("mean", "sum_segment")),
                ("cross_attention", ("per_concept", "replicated")),
            ):
                if name == "cross_attention" and c.cross_attention == "auto":  # the machine chose the function
                    problems.append(("concept.cross_attention", _NO_AUTO))
                elif getattr(c, name) not in allowed:
                    problems.append((f"concept.{name}", f"must be one of {', '.join(allowed)}, got {getattr(c, name)!r}"))
        chosen = [("residual", "residual", self.residual), ("objective", "objective", self.objective)]
        if c.enabled:
            chosen += [("concept.segmentation", "segmentation", c.segmentation),
                       ("concept.coupling", "coupling", c.coupling)]
        for key, kind, name in chosen:
            if not isinstance(name, str):
                problems.append((key, f"must be a name, got {name!r}"))
            elif name not in STRATEGIES[kind]:  # an import path: import it now, so errors come early
                try:
                    strategy(kind, name)
                except ConfigError as e:
                    problems.extend((key, m) for _, m in e.problems)
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
        problems += self._check_residuals(law)
        bottleneck_problems, self.bottleneck_unknown, self.bottleneck_rank = _check_bottleneck(self.bottleneck, self.d_model)
        problems += bottleneck_problems
        if problems:
            raise ConfigError(problems)
        if not c.enabled or c.coupling != "cross_attention":  # unused: one value, whatever a checkpoint recorded
            c.cross_attention = "per_concept"
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
        self._check_steer_layer()

    def _check_steer_layer(self) -> None:
        """``bottleneck.steer_at``'s layer must exist in its stack (the stacks' sizes are known only now)."""
        if not self.bottleneck.enabled:
            return
        stack, layer = steer_site(self.bottleneck.steer_at)
        n = {"encoder": self.encoder_layers, "decoder": self.decoder_layers}.get(stack)
        if n is not None and not 0 <= layer < n:
            raise ConfigError([("bottleneck.steer_at", f"the {stack} has layers 0..{n - 1}, got {layer}")])

    @property
    def mup_widths(self) -> tuple[float, float] | None:
        """Decoupled muP's width multipliers (s_token, s_concept) = (d_model, d_concept) / their base
        widths (DLCM Sec. 6.1); None when ``mup_base_width`` is null (standard parametrization)."""
        if self.mup_base_width is None:
            return None
        base_c = self.mup_base_concept_width or self.mup_base_width
        return self.d_model / self.mup_base_width, self.concept_cfg.d_model / base_c

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
        import importlib

        # family.py's lookup, imported the way strategies are (this module has no relative imports)
        fam = importlib.import_module(".family", __package__).family(self.backbone)  # ConfigError if unknown
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
        if self.norm_placement not in ("pre", "post"):
            problems.append(("norm_placement", f"must be pre or post, got {self.norm_placement!r}"))
        for name in ("mup_base_width", "mup_base_concept_width"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                problems.append((name, f"must be a positive integer (a width) or null, got {v!r}"))
        if self.mup_base_concept_width is not None and self.mup_base_width is None:
            problems.append(("mup_base_concept_width", "decoupled muP is off (mup_base_width: null); set "
                                                       "mup_base_width too"))
        if self.init not in ("hf", "gpt2", "gpt-neox"):
            problems.append(("init", f"must be hf, gpt2 or gpt-neox, got {self.init!r}"))
        if self.mtp_depth is not None and (not isinstance(self.mtp_depth, int) or self.mtp_depth < 1):
            problems.append(("mtp_depth", f"must be >= 1 (null turns MTP off), got {self.mtp_depth!r}"))
        sched = self.mtp_weight_schedule
        if not isinstance(sched, list) or not all(isinstance(x, list) and len(x) == 2 for x in sched):
            problems.append(("mtp_weight_schedule", f"must be a list of [from_step, weight] pairs, got {sched!r}"))
        return problems

    def _check_residuals(self, law: SegmentationLaw | None) -> list[tuple[str, str]]:
        """IRC / CRC keys (NCP-ArchPreview Sec. 2.6)."""
        problems = []
        for name in ("irc_hidden", "crc_hidden"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                problems.append((name, f"must be a positive integer, got {v!r}"))
        if self.irc_normalize not in ("none", "softmax"):
            problems.append(("irc_normalize", f"must be none or softmax, got {self.irc_normalize!r}"))
        if self.crc_mode not in CRC_MODES:
            problems.append(("crc_mode", f"must be one of {', '.join(CRC_MODES)}, got {self.crc_mode!r}"))
        problems += self._check_attnres(law)
        links = self.crc_connections
        if not isinstance(links, list) or any(x not in CRC_CONNECTIONS for x in links) or len(set(links)) != len(links):
            return problems + [("crc_connections", f"must be distinct names from {', '.join(CRC_CONNECTIONS)}, "
                                                   f"got {links!r}")]
        if links and not self.concept.enabled:
            problems.append(("crc_connections", "cross-module residuals connect the encoder, concept and decoder "
                                                "modules: they need the concept path (model.concept.enabled)"))
        elif "encoder-concept" in links and law is not None and not law.pools_any_width:
            problems.append(("crc_connections", f"encoder-concept pools every encoder depth, which segmentation "
                                                f"{self.concept.segmentation!r} cannot (its law: pools_any_width)"))
        return problems

    def _check_attnres(self, law: SegmentationLaw | None) -> list[tuple[str, str]]:
        """Block AttnRes keys (``residual: block_attnres``)."""
        v, problems = self.attnres_block, []
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            problems.append(("attnres_block", f"must be a positive integer, got {v!r}"))
        if not isinstance(self.attnres_cross, bool):
            problems.append(("attnres_cross", f"must be true or false, got {self.attnres_cross!r}"))
        if self.residual != "block_attnres":
            return problems
        if self.crc_connections:
            problems.append(("crc_connections", "residual: block_attnres has its own cross-module connections "
                                                "(attnres_cross); CRC connects IRC-style depths: use [] here"))
        if self.attnres_cross and self.concept.enabled and law is not None and not law.pools_any_width:
            problems.append(("attnres_cross", f"the encoder's block states are pooled to the concepts, which "
                                              f"segmentation {self.concept.segmentation!r} cannot (its law: "
                                              f"pools_any_width); set attnres_cross: false"))
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
    def tokens_per_concept(self) -> float | None:
        """Mean segment length of the segmentation (k for fixed blocks); None without the path."""
        c = self.concept
        return segmentation_law(c.segmentation).tokens_per_concept(c) if c.enabled else None

    # ---- (de)serialisation: checkpoints carry this dict (style rule 7) ----
    def to_dict(self) -> dict[str, Any]:
        """Init fields only (derived ones are recomputed on load)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["concept"] = dataclasses.asdict(self.concept)
        out["bottleneck"] = dataclasses.asdict(self.bottleneck)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["concept"] = ConceptConfig(**d.get("concept", {}))
        d["bottleneck"] = BottleneckConfig(**d.get("bottleneck", {}))  # checkpoints before it: off
        return cls(**d)


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
