"""The recipe keys of ``objective: causal_diffusion`` (Steerling's Causal Diffusion LM, diffusion.py):
``DiffusionConfig`` (``model.diffusion.*``) and the section that puts it on ``ModelConfig`` with its
checks and the special token the objective needs in the tokenizer (``section_tokens``: ``ncpctl
tokenize`` adds it, the recipe loader reads its id into ``diffusion.mask_id``). Stdlib only
(config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ncpctl.model.core.config_base import Section, is_number, is_positive_int, option

NAME = "causal_diffusion"  # the objective's registered name (registry.py)
SCHEDULES = ("uniform", "gaussian")
WEIGHTINGS = ("masked_mean", "inverse_t")
OLD_WEIGHTINGS = {"elbo": "inverse_t"}  # a checkpoint or recipe written before the rename reads as the new name


@dataclass
class DiffusionConfig:
    """Steerling's Causal Diffusion LM (shared/papers/004: MDLM, Block Diffusion, Causal Diffusion):
    block-causal attention over blocks of ``block_size`` tokens; training reads one noisy copy in
    which each block b draws a mask rate t_b and each of its tokens becomes [MASK] with probability
    t_b; the loss is the cross-entropy of the masked tokens at their own positions (no shift)."""

    block_size: int = option(
        64, "Tokens per diffusion block: attention is bidirectional inside a block and causal across blocks "
        "(q // block >= k // block); each block draws its own mask rate (Steerling: 64). Must divide train.seq_len.")
    schedule: Literal["uniform", "gaussian"] = option(
        "uniform", "How each block's mask rate t_b is drawn: uniform = t_b ~ U(min_t, 1) (MDLM; Steerling's "
        "mid-training); gaussian = Steerling's moving Gaussian masking curriculum (pre-training): t_b ~ N(mu, "
        "gaussian_std) clipped to [min_t, 1], mu moving linearly from gaussian_mean_start to gaussian_mean_end "
        "over gaussian_steps optimizer steps (the paper gives no parameters; see those keys). Validation draws "
        "with the same schedule (gaussian: at the current step's mean).")
    gaussian_mean_start: float = option(
        0.3, "schedule: gaussian: the mean mask rate at step 0 (the paper gives none; 0.3 starts on mostly "
        "visible blocks).")
    gaussian_mean_end: float = option(
        0.6, "schedule: gaussian: the mean mask rate from gaussian_steps on (the notes record that Steerling's "
        "curriculum ended over 50% masked late in pre-training; 0.6).")
    gaussian_std: float = option(0.15, "schedule: gaussian: the standard deviation of t_b (the paper gives none).")
    gaussian_steps: int = option(1000, "schedule: gaussian: optimizer steps of the linear move of the mean.")
    min_t: float = option(
        1e-3, "The smallest mask rate drawn (t_b in [min_t, 1]): bounds the inverse_t weighting's 1/t (MDLM's "
        "eps).")
    weighting: Literal["masked_mean", "inverse_t"] = option(
        "masked_mean", "The training loss over the masked tokens M of a batch: masked_mean = the mean of "
        "-log p(x_i | x_t) over M (Steerling's L = E_t[1/|M| sum_{i in M} -log p]; the mean is over the masked "
        "tokens of the whole micro-batch, so a block weighs in proportion to its rate t_b); inverse_t = each "
        "masked token's cross-entropy weighted by 1/t_b of its block, summed and divided by the number of tokens "
        "(MDLM's weighting; with one noisy copy each block conditions on NOISED earlier blocks, so it is a "
        "training loss, not a bound on the model as sampled: the bound is validation's diffusion_elbo). "
        "schedule: uniform only (under gaussian, 1/t without a 1/q(t) importance weight bounds nothing). "
        "Formerly named elbo (still read as inverse_t).")
    eval_samples: int = option(
        4, "Monte Carlo samples of the held-out ELBO at each validation (diffusion_elbo.py): the validation "
        "record's diffusion_elbo (the bound on the NLL per token, each block scored on the clean earlier ones) and "
        "diffusion_elbo_stderr (its Monte Carlo standard error over the samples: at least 4, since 2 give an interval with one degree of freedom). Each sample costs about "
        "(blocks + 1) / 2 forwards of a validation window; 0 = no ELBO at validation. ncpctl eval takes its own "
        "count (--diffusion-samples).")
    mask_token: str = option(
        "<|mask|>", "The [MASK] token's text: ncpctl tokenize adds it as a special token after the EOD token "
        "(a trained BPE: id 1); a tokenizer.path without it is refused.")
    mask_id: int | None = option(
        None, "The [MASK] token's id; null = read from the tokenizer when the recipe is loaded (set it only for "
        "a model built without a recipe).")


def _check(d: DiffusionConfig, cfg: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if not is_positive_int(d.block_size):
        out.append(("diffusion.block_size", f"must be a positive integer, got {d.block_size!r}"))
    if d.schedule not in SCHEDULES:
        out.append(("diffusion.schedule", f"must be one of {', '.join(SCHEDULES)}, got {d.schedule!r}"))
    if d.weighting not in WEIGHTINGS:
        out.append(("diffusion.weighting", f"must be one of {', '.join(WEIGHTINGS)}, got {d.weighting!r}"))
    elif d.weighting == "inverse_t" and d.schedule == "gaussian":
        out.append(("diffusion.weighting", "inverse_t with schedule: gaussian weights by 1/t without the Gaussian "
                                           "curriculum's 1/q(t) importance weight, which is no bound: use masked_mean "
                                           "(Steerling's) or schedule: uniform"))
    if not is_number(d.min_t) or not 0 < d.min_t < 1:
        out.append(("diffusion.min_t", f"must be in (0, 1), got {d.min_t!r}"))
    for key in ("gaussian_mean_start", "gaussian_mean_end"):
        v = getattr(d, key)
        if not is_number(v) or not 0 <= v <= 1:
            out.append((f"diffusion.{key}", f"must be in [0, 1], got {v!r}"))
    if not is_number(d.gaussian_std) or d.gaussian_std <= 0:
        out.append(("diffusion.gaussian_std", f"must be a number > 0, got {d.gaussian_std!r}"))
    if not isinstance(d.gaussian_steps, int) or isinstance(d.gaussian_steps, bool) or d.gaussian_steps < 0:
        out.append(("diffusion.gaussian_steps", f"must be an integer >= 0, got {d.gaussian_steps!r}"))
    if not isinstance(d.eval_samples, int) or isinstance(d.eval_samples, bool) or d.eval_samples < 0:
        out.append(("diffusion.eval_samples", f"must be an integer >= 0, got {d.eval_samples!r}"))
    if not isinstance(d.mask_token, str) or not d.mask_token:
        out.append(("diffusion.mask_token", f"must be a non-empty string, got {d.mask_token!r}"))
    m = d.mask_id
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < cfg.padded_vocab_size):
        out.append(("diffusion.mask_id", f"must be a token id in [0, {cfg.padded_vocab_size}), got {m!r}"))
    if cfg.mtp_depth is not None:
        out.append(("mtp_depth", f"multi-token prediction reads later tokens through a shift, which objective: {NAME} "
                                 "does not have; set it to null"))
    c = cfg.bottleneck.chunk
    if cfg.bottleneck.enabled and is_positive_int(c) and is_positive_int(d.block_size) and d.block_size % c:
        out.append(("bottleneck.chunk", f"{c} must divide model.diffusion.block_size={d.block_size} (objective: "
                                        f"{NAME} reads a chunk's concepts inside one block; Steerling: both 64)"))
    if cfg.concept.enabled:
        out.append(("concept.enabled", "the concept path predicts the next concept (the NCP shift), which "
                                       f"objective: {NAME} does not have (no shift); turn one off"))
    return out


@dataclass
class DiffusionSection(Section):
    """``model.diffusion`` on ``ModelConfig``: read only when ``objective`` is causal_diffusion."""

    diffusion: DiffusionConfig = option(DiffusionConfig, "Steerling's Causal Diffusion LM (objective: causal_diffusion).")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        if isinstance(self.diffusion, dict):  # from a recipe or a checkpoint
            self.diffusion = DiffusionConfig(**self.diffusion)
        d = self.diffusion
        d.weighting = OLD_WEIGHTINGS.get(d.weighting, d.weighting) if isinstance(d.weighting, str) else d.weighting
        return _check(self.diffusion, cfg) if self.objective == NAME else []

    def section_tokens(self, cfg: Any) -> dict[str, str]:
        """The special tokens this section's design needs in the tokenizer: key path of the id -> text."""
        return {"diffusion.mask_id": self.diffusion.mask_token} if self.objective == NAME else {}


    def section_seq_len(self, cfg: Any, seq_len: int) -> list[tuple[str, str]]:
        """Problems of training or evaluating on ``seq_len``-token windows: whole blocks only."""
        b = self.diffusion.block_size
        if self.objective != NAME or not is_positive_int(b) or seq_len % b == 0:
            return []
        return [("train.seq_len", f"{seq_len} is not a multiple of model.diffusion.block_size={b} "
                                  f"(objective: {NAME} noises and attends whole blocks)")]
