"""The recipe keys of Steerling's additive concept bottleneck (bottleneck.py): ``BottleneckConfig``
(``model.bottleneck.*``), the section that puts it on ``ModelConfig`` with its checks and derived
sizes (``bottleneck_unknown``, ``bottleneck_rank``), and ``steer_site``. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ncpctl.model.core.config_base import Section, option

BOTTLENECK_INDEPENDENCE = ("known_unknown", "known_unknown_residual")


@dataclass
class BottleneckConfig:
    """Steerling's additive concept bottleneck (bottleneck.py): between the final norm and the LM
    head, h = k K + u (A B) + e, with n labelled (known) concepts and m unknown ones. Defaults are
    Steerling-8B's pre-training values (shared/papers/004: chunk 64, m = 3n, rank 256, dropout 0.1,
    teacher forcing 1 -> 0.5); where the paper gives no number the choice is said."""

    enabled: bool = option(False, "Turn the concept bottleneck on (Steerling); off = the LM head reads h directly.")
    concepts: int | None = option(None, "n: labelled (known) concepts, the width of the labels (required when enabled).")
    unknown: int | None = option(None, "m: unknown concepts; null = 3n (Steerling: m = 3n).")
    rank: int | None = option(
        None, "r: rank of the unknown embedding U = A B (A: (m, r), B: (r, d)); null = Steerling's 256, capped to "
        "d_model and m (an explicit value above either is an error).")
    chunk: int = option(64, "Tokens per label chunk: the concept loss ORs a chunk's tokens, chunks start at position 0 "
                        "(Steerling: 64, its diffusion block). objective: causal_diffusion: it must divide "
                        "diffusion.block_size, and the concept loss ORs the chunk's masked tokens only.")
    dropout: float = option(0.1, "Dropout on the residual e in training only, so the concepts must carry the signal "
                             "(Steerling: 0.1 pre-training, 0.3 mid-training).")
    concept_weight: float = option(1.0, "Weight of the chunk-level concept BCE (the paper gives no value: 1).")
    reconstruction_weight: float = option(
        1.0, "Weight of the reconstruction loss: mean squared error of u U toward h - k_true K (the paper gives "
        "no value: 1).")
    independence_weight: float = option(
        1.0, "Weight of the linear cross-covariance independence penalty (the paper gives no value: 1).")
    independence: Literal["known_unknown", "known_unknown_residual"] = option(
        "known_unknown", "Independence penalty between kK and uU (pre-training); known_unknown_residual adds uU vs "
        "e (Steerling's mid-training variant).")
    teacher_forcing_start: float = option(
        1.0, "Teacher-forcing probability at step 0: a chunk's known concepts replaced by the labels of the chunk "
        "before it, the last that closed (Steerling: annealed from 1; never the labels of t's own chunk or later; "
        "refused on document-level labels). objective: causal_diffusion: the labels of t's own diffusion block "
        "instead (the block is generated jointly: the one exception; later blocks' labels never reach t).")
    teacher_forcing_end: float = option(
        0.5, "Teacher-forcing probability after teacher_forcing_steps (Steerling: 0.5 pre-training, 0 mid-training).")
    teacher_forcing_steps: int = option(
        1000, "Optimizer steps of the linear anneal start -> end (the paper does not give its length).")
    unknown_head: Literal["dense", "low_rank"] = option(
        "dense", "g, the unknown head's predictor: dense = Linear(d, m); low_rank = Linear(d, r) then Linear(r, m) "
        "with the rank r of U (Steerling's released code factorises it so; at 8B it cuts the module's parameters "
        "about in half).")
    bias: bool = option(
        True, "Biases on the concept heads' logits (f, and g's last layer): ncpctl's default, the known bias starting at "
        "a prior (each chunk's OR near 1/2); false = Steerling's released code (steerling 0.2.0: no bias in either head).")
    logit_clamp: float | None = option(
        None, "Clamp both heads' logits to [-c, c] before the sigmoid and the top-k (Steerling's released code: 15, "
        "its ConceptHead); null = no clamp.")
    top_k_known: int | None = option(None, "Keep the top-k known activations per token; null = dense (Steerling "
                                       "mid-training: 32).")
    top_k_unknown: int | None = option(None, "Keep the top-k unknown activations per token; null = dense (Steerling "
                                         "mid-training: 128).")
    # Steerling's steering stages (mid-training, 4 x 90 steps): inject a labelled concept's direction
    # where the labels say the text carries it, and teach the model to respond (bottleneck.py)
    respond_weight: float = option(
        0.0, "Steering stage: weight of L_respond = -mean log k_c at the positions where concept c's direction "
        "was injected (Steerling; 0 = no steering stage). With express_weight > 0 too, training injects.")
    express_weight: float = option(
        0.0, "Steering stage: weight of L_express = -mean log sum_{y in T_c} p(y) at the injected positions, T_c "
        "the concept's lift tokens (the tokens most over-represented in its labelled spans of the train split).")
    steer_at: str = option(
        "readout", "Steering stage: where the direction is added in training: readout (the bottleneck's output, "
        "what the LM head reads: Steerling's concept intervention, raising k_c), decoder_input, encoder.L or "
        "decoder.L (after layer L of that stack); generate --steer's at= names these sites the same way. "
        "readout is the default because it is where steering worked at the debug size (bench/steering.py).")
    steer_strength: float = option(
        2.0, "Steering stage: the injection's strength in nominal logit units, gamma = strength / peak(W_lm e_c) "
        "over the real vocabulary, as generate --steer ...,strength=S logit defines it (Steerling's tau / peak(e_c), "
        "whose value the paper does not give).")
    steer_fraction: float = option(
        0.5, "Steering stage: the probability that a training row is injected (with one of the concepts its "
        "labels carry, drawn uniformly); the other rows train as plain language modelling.")
    lift_tokens: int = option(16, "Steering stage: |T_c|, lift tokens per concept for L_express.")


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
    if not isinstance(b.bias, bool):
        problems.append(("bottleneck.bias", f"must be true or false, got {b.bias!r}"))
    if b.logit_clamp is not None and (not num(b.logit_clamp) or not b.logit_clamp > 0):
        problems.append(("bottleneck.logit_clamp", f"must be a number > 0 or null, got {b.logit_clamp!r}"))
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
class BottleneckSection(Section):
    """``model.bottleneck`` on ``ModelConfig``, with m and r resolved (0 without the bottleneck)."""

    bottleneck: BottleneckConfig = option(BottleneckConfig, "Steerling's additive concept bottleneck before the LM head.")
    bottleneck_unknown: int = field(init=False)  # m (0 without the bottleneck)
    bottleneck_rank: int = field(init=False)  # r of U = A B (0 without the bottleneck)

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        if isinstance(self.bottleneck, dict):  # from a recipe or a checkpoint
            self.bottleneck = BottleneckConfig(**self.bottleneck)
        problems, self.bottleneck_unknown, self.bottleneck_rank = _check_bottleneck(self.bottleneck, self.d_model)
        return problems

    def section_settle(self, cfg: Any) -> list[tuple[str, str]]:
        """``bottleneck.steer_at``'s layer must exist in its stack (the stacks' sizes are known only now)."""
        if not self.bottleneck.enabled:
            return []
        stack, layer = steer_site(self.bottleneck.steer_at)
        n = {"encoder": self.encoder_layers, "decoder": self.decoder_layers}.get(stack)
        if n is not None and not 0 <= layer < n:
            return [("bottleneck.steer_at", f"the {stack} has layers 0..{n - 1}, got {layer}")]
        return []



class BottleneckCost:
    """The cost model's view of the bottleneck (accounting_parts.py, accounting_backward.py), per
    sequence. Forward: f (d -> n), k K (n -> d), g (d -> m), u A (m -> r), (u A) B (r -> d).
    Training only, each counted with its own backward: the independence penalty's cross-covariance
    (B*T, d)^T (B*T, d), forward and both operands' gradients (3x; twice with the residual term),
    and the reconstruction target k_true K of the labels (forward only: labels and sg(K)). A steering
    stage (respond or express weight > 0) adds the head's response to each row's drawn direction
    (W e over the real vocabulary, forward only: it sets gamma) and, with the express loss, per
    injected position (``steered``, default ``steer_fraction * T``) the head on the injected
    direction and on the state (forward) and the head weight's gradient from the direction (at the
    readout; at a layer: the head on the state, forward and both gradients)."""

    @staticmethod
    def flops(cfg: Any, T: int, steered: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """(forward components, training-only work)."""
        b = cfg.bottleneck
        d, n, m, r = cfg.d_model, b.concepts, cfg.bottleneck_unknown, cfg.bottleneck_rank
        comps = {"bottleneck.known": 2 * T * d * n, "bottleneck.known_embed": 2 * T * n * d,
                 "bottleneck.unknown": 2 * T * d * m if b.unknown_head == "dense" else 2 * T * r * (d + m),
                 "bottleneck.unknown_A": 2 * T * m * r,
                 "bottleneck.unknown_B": 2 * T * r * d}
        pairs = 2 if b.independence == "known_unknown_residual" else 1
        training = {"bottleneck.independence": 3 * pairs * 2 * T * d * d,
                    "bottleneck.reconstruction_target": 2 * T * n * d}
        if b.respond_weight > 0 or b.express_weight > 0:
            training["bottleneck.steer_response"] = 2 * d * cfg.vocab_size
            if b.express_weight > 0:
                slots = b.steer_fraction * T if steered is None else steered
                training["bottleneck.express"] = round(slots * 3 * 2 * d * cfg.padded_vocab_size)
        return comps, training

    @staticmethod
    def backward(cfg: Any, comps: dict[str, int], h: bool, walk: Any) -> bool:
        """The backward on final states that carry a gradient (``h``), through ``walk``: the model's
        backward walk scoped to the bottleneck's parameters (``linear(key, module, f, rg)`` a weight
        matmul, returning whether its output carries a gradient; ``has(name)`` whether a parameter
        trains; ``add(key, flops)``). f and k K are linears; g reads sg(h) (a weight gradient only),
        and (u A) B gets gradients from the reconstruction and independence losses alone (the LM
        reads sg(u_hat)). Returns whether h_bar carries a gradient."""
        k = walk.linear("bottleneck.known", "known", comps["bottleneck.known"], h)
        walk.add("bottleneck.known_embed", comps["bottleneck.known_embed"] * (k + walk.has("K")))
        if cfg.bottleneck.unknown_head == "dense":
            u = walk.linear("bottleneck.unknown", "unknown", comps["bottleneck.unknown"], False)
        else:  # d -> r (no input gradient: sg(h)) -> m
            d, r = cfg.d_model, cfg.bottleneck_rank
            down = comps["bottleneck.unknown"] * d // (d + cfg.bottleneck_unknown)
            u = walk.linear("bottleneck.unknown", "unknown.0", down, False)
            u = walk.linear("bottleneck.unknown", "unknown.1", comps["bottleneck.unknown"] - down, u)
        walk.add("bottleneck.unknown_A", comps["bottleneck.unknown_A"] * (u + walk.has("A")))
        walk.add("bottleneck.unknown_B", comps["bottleneck.unknown_B"] * ((u or walk.has("A")) + walk.has("B")))
        return h or k or walk.has("K")
