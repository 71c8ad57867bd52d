"""The recipe keys of ``segmentation: dynamic`` (DLCM's learned boundaries, dynamic.py): the
section ``ConceptConfig`` composes (``model.concept.boundary_mode``, ``target_ratio``, ...), their
checks and the segmentation's law. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from ncpctl.model.core.config_base import SegmentationLaw, Section, is_number, option

BOUNDARY_MODES = ("predictor", "boundary")
BALANCES = ("global", "sequence")


@dataclass
class DynamicSection(Section):
    """DLCM Sec. 3.3, 8.1: how boundaries are found and how their rate is held at 1/R."""

    boundary_mode: Literal["predictor", "boundary"] = option(
        "predictor", "segmentation: dynamic. predictor = DLCM Sec. 3.3.1: p_t = (1 - cos(W_q h[t-1], W_k h[t]))/2, "
        "W_q = W_k = I at init, p_0 = 1, trained by the balance loss only; boundary = Sec. 8.1's rule: a boundary "
        "where (1 - cos(h[t-1], h[t]))/2 >= boundary_tau (no parameters, the same in training and inference).")
    boundary_temperature: float = option(
        0.1, "predictor, training: boundaries are Bernoulli(sigmoid(logit(p)/temperature)); < 1 sharpens p away "
        "from 0.5 toward the inference rule p >= 0.5 (temperature -> 0), 1 = Bernoulli(p). The paper names a "
        "temperature but no value; 0.1 keeps the inference rate near the trained one (debug-dlcm, 200 steps: "
        "validation tokens per concept 4.2-4.3 at R = 4, against 6.1 with 0.5).")
    boundary_threshold: float = option(0.5, "predictor, inference: b_t = [p_t >= threshold] (DLCM: 0.5).")
    boundary_tau: float | None = option(
        None, "boundary mode: the threshold tau on (1 - cos(h[t-1], h[t]))/2; required there.")
    boundary_grad_to_encoder: bool = option(
        False, "predictor: let the balance loss's gradient reach the encoder through h (false: W_q and W_k see "
        "h detached, so only they learn from it). The LM loss never reaches W_q, W_k.")
    target_ratio: float = option(4.0, "R: target tokens per concept of segmentation: dynamic (DLCM: 4); boundary rate 1/R.")
    balance: Literal["global", "sequence"] = option(
        "global", "Load balance L_aux (DLCM Eq. 10) over: global = the global batch (the Global Parser; F is the "
        "previous optimizer step's global boundary rate, G the batch mean of p); sequence = each sequence's own "
        "F and G, averaged (Table 4's Normal).")
    balance_weight: float = option(
        0.03, "lambda: weight of L_aux in the loss (the DLCM notes give none; 0.03 is H-Net's ratio-loss weight).")


def _check_dynamic(c: DynamicSection, cfg: object) -> list[tuple[str, str]]:
    """The keys of ``segmentation: dynamic`` (DLCM Sec. 3.3, 8.1), run when it is the segmentation."""
    out = []
    if c.boundary_mode not in BOUNDARY_MODES:
        out.append(("boundary_mode", f"must be one of {', '.join(BOUNDARY_MODES)}, got {c.boundary_mode!r}"))
    if not is_number(c.target_ratio) or c.target_ratio <= 1:
        out.append(("target_ratio",
                    f"R must be a number > 1 (the target boundary rate is 1/R), got {c.target_ratio!r}"))
    if c.balance not in BALANCES:
        out.append(("balance", f"must be one of {', '.join(BALANCES)}, got {c.balance!r}"))
    if not is_number(c.balance_weight) or c.balance_weight < 0:
        out.append(("balance_weight", f"must be a number >= 0, got {c.balance_weight!r}"))
    if not is_number(c.boundary_temperature) or c.boundary_temperature <= 0:
        out.append(("boundary_temperature", f"must be a number > 0, got {c.boundary_temperature!r}"))
    if not is_number(c.boundary_threshold) or not 0 < c.boundary_threshold < 1:
        out.append(("boundary_threshold", f"must be in (0, 1), got {c.boundary_threshold!r}"))
    if c.boundary_mode == "boundary":
        if c.boundary_tau is None:
            out.append(("boundary_tau", "boundary_mode: boundary compares (1 - cos(h[t-1], h[t]))/2 against tau; "
                                        "none given"))
        elif not is_number(c.boundary_tau) or not 0 < c.boundary_tau < 1:
            out.append(("boundary_tau", f"must be in (0, 1), got {c.boundary_tau!r}"))
    return out


# Data-dependent boundaries (DLCM): at most T - 1 segments close within T tokens (the last one is
# still open); the cost model counts int(T / R) concepts at the target ratio R (not T // R, which
# is 79.0 for 256 // 3.2); the 1e-9 keeps a realised ratio T / M at M concepts (32 / (32 / 13) is 12.99..).
DYNAMIC = SegmentationLaw(concepts=lambda c, T: max(T - 1, 0), tokens_per_concept=lambda c: float(c.target_ratio),
                          check=_check_dynamic, expected_concepts=lambda c, T: int(T / c.target_ratio + 1e-9))


class Cost:
    """The cost model's view of ``segmentation: dynamic`` (accounting.py asks ``design_cost``):
    the boundary predictor's W_q, W_k on every token (mode predictor; the boundary rule has no
    parameters) and the pooling, one batched GEMM of the (M, T) segment indicator with h
    (``segment_means``). The cosine and the smoothing are elementwise (not counted)."""

    @staticmethod
    def flops(cfg: object, T: int, M: int) -> dict[str, int]:
        c, d = cfg.concept, cfg.d_model  # type: ignore[attr-defined]
        out = {"concept.pooling": 2 * M * T * d}  # (M, T) indicator x (T, d): the padded M of the batch
        if c.boundary_mode == "predictor":
            out["concept.boundary_predictor"] = 2 * (2 * T * d * d)
        return out

    @staticmethod
    def backward(cfg: object, T: int, M: int, fwd: dict[str, int], grads_in: bool,
                 trains: Callable[[str], bool]) -> dict[str, int]:
        """Backward FLOPs when h carries a gradient (``grads_in``) and ``trains(prefix)`` says which
        of the segmenter's parameters train: the pooling's input gradient only (the indicator is
        a constant); W_q and W_k's weight gradients, and their input gradient only when the
        boundary loss reaches the encoder (``boundary_grad_to_encoder``; by default they read sg(h))."""
        c = cfg.concept  # type: ignore[attr-defined]
        out = {"concept.pooling": fwd["concept.pooling"] * grads_in}
        if "concept.boundary_predictor" in fwd:
            half = fwd["concept.boundary_predictor"] // 2
            into_h = grads_in and c.boundary_grad_to_encoder
            out["concept.boundary_predictor"] = half * (2 * into_h + trains("q.") + trains("k."))
        return out
