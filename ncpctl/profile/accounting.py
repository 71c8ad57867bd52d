"""``accounting`` section: parameters and training FLOPs of a recipe and its siblings.

Siblings (spec section 6, ConceptLM's three-way comparison):

* ``recipe``: the model as the recipe configures it;
* ``base``:   the same backbone without the concept path (and no extra token layers);
* ``pm``:     the parameter-matched baseline: base + C token layers (C = the recipe's
              concept layers, default 2), no concept path.

Each gets the paper view (ConceptLM App. C formula, concept layers at their own width
``d_concept``) and the exact view (real shapes, matmul FLOPs; attention counted in full, the one
convention of budgets, fits and MFU: ``ncpctl.model.accounting.flops.FLOP_CONVENTION``, with the
causal-mask count, what flash kernels compute, under ``*_causal`` keys) side by side, plus its
share of compute in the concept path. Pure arithmetic on the config apart from the parameter count, which
builds the model on the meta device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ncpctl.model.accounting.flops import (FLOP_CONVENTION, at_realised_ratio, count_parameters, exact_flops, paper_flops,
                                     saving, tokens_per_concept)
from ncpctl.model.accounting.memory import activation_memory
from ncpctl.model.core.config import ConfigError, ModelConfig

VARIANTS = ("recipe", "base", "pm")


def siblings(cfg: ModelConfig) -> dict[str, ModelConfig]:
    """The recipe's model and its base and PM siblings, and (when the recipe is not ConceptLM
    itself) its ConceptLM sibling: the base plus the recipe's concept settings. The base and PM
    siblings have no modules to connect, so they drop CRC (and keep IRC, a per-stack mixer)."""
    d = cfg.to_dict()
    C = d["concept"]["concept_layers"]
    base = {**d, "extra_token_layers": 0, "crc_connections": [], "concept": {**d["concept"], "enabled": False}}
    pm = {**base, "extra_token_layers": C}
    out = {"recipe": cfg, "base": ModelConfig.from_dict(base), "pm": ModelConfig.from_dict(pm)}
    out["base"].name, out["pm"].name = f"{cfg.name} base", f"{cfg.name} PM (+{C} token layers)"
    if not cfg.concept.enabled:
        try:
            out["conceptlm"] = ModelConfig.from_dict({**base, "concept": {**d["concept"], "enabled": True}})
        except ConfigError:  # the recipe's designs exclude the concept path (e.g. an objective without a shift)
            return out
        out["conceptlm"].name = f"{cfg.name} ConceptLM"
    return out


def describe_variant(cfg: ModelConfig, seq_len: int, micro_batch: int, global_batch: int,
                     params: bool = True, precision: str = "bf16") -> dict[str, Any]:
    paper = paper_flops(cfg, seq_len)
    exact = exact_flops(cfg, seq_len, micro_batch)
    tokens_per_step = seq_len * global_batch
    accum = global_batch / micro_batch  # micro-batches per optimizer step (all ranks)
    out: dict[str, Any] = {
        "name": cfg.name,
        "concept": cfg.concept.enabled,
        "token_layers": cfg.n_token_layers,
        "concept_layers": cfg.concept.concept_layers if cfg.concept.enabled else 0,
        "k": tokens_per_concept(cfg),  # the segmentation's mean tokens per concept (k for fixed blocks)
        "d_model": cfg.d_model,
        "d_concept": paper.d_concept,  # the concept layers' width, at which both views count them
        "block_equivalents": cfg.block_equivalents,
        "parameter_equivalent_layers": paper.parameter_equivalent_layers,
        "params": count_parameters(cfg).to_dict() if params else None,
        "paper": {
            "formula": paper.formula,
            "training_formula": paper.training_formula,
            "forward_per_token": paper.forward_per_token,
            "training_per_token": paper.training_per_token,
            "training_per_step": paper.training_per_token * tokens_per_step,
        },
        "exact": {
            "components": exact.components,
            "attention_causal": exact.attention_causal,
            "training_only": exact.training_only,
            "flop_convention": FLOP_CONVENTION,
            "training_per_token": exact.training_per_token,
            "training_per_token_causal": exact.training_per_token_causal,
            # per optimizer step: micro-batch FLOPs (per-step work like the codebook transform
            # runs once per micro-batch) times the micro-batches of the step; the budget's and MFU's count
            "training_per_step": exact.training_per_step() * accum,
            "training_per_step_causal": exact.training_per_step(causal=True) * accum,
            "training_per_micro_batch": exact.training_per_step(),
            "training_per_micro_batch_causal": exact.training_per_step(causal=True),
            "concept_share": exact.concept_share,
            "concept_share_causal": exact.concept_share_causal,
        },
        # bytes saved for the backward of one micro-batch per train.activation_checkpointing mode,
        # flash-type SDPA (no T x T scores), in the recipe's precision (accounting_memory.py)
        "activation_memory": activation_memory(cfg, seq_len, micro_batch, precision).to_dict(),
    }
    return out


def accounting_section(cfg: ModelConfig, seq_len: int, micro_batch: int = 1, global_batch: int | None = None,
                       params: bool = True, realised_ratio: float | None = None,
                       precision: str = "bf16") -> dict[str, Any]:
    """Paper and exact FLOPs, parameters, savings of ``recipe`` vs ``base`` and ``pm``.
    ``realised_ratio``: the recipe's dynamic segmentation costed at this measured tokens per
    concept instead of its target R (``ncpctl.model.accounting.flops.at_realised_ratio``); ``precision``
    (fp32, bf16, fp16): the activations' dtype for the activation memory."""
    law = cfg.law  # a data-dependent segmentation is costed at its target tokens per concept (DLCM's R)
    target = law.tokens_per_concept(cfg.concept) if law is not None and law.variable_length else None
    cfg = at_realised_ratio(cfg, realised_ratio)
    global_batch = global_batch or micro_batch
    variants = {name: describe_variant(c, seq_len, micro_batch, global_batch, params, precision)
                for name, c in siblings(cfg).items()}
    savings: dict[str, Any] = {}
    for other in ("base", "pm"):
        savings[f"recipe_vs_{other}"] = {
            "paper": saving(variants[other]["paper"]["training_per_token"], variants["recipe"]["paper"]["training_per_token"]),
            "exact": saving(variants[other]["exact"]["training_per_token"], variants["recipe"]["exact"]["training_per_token"]),
            "exact_causal": saving(variants[other]["exact"]["training_per_token_causal"],
                                   variants["recipe"]["exact"]["training_per_token_causal"]),
            "flops_ratio_exact": variants["recipe"]["exact"]["training_per_token"] / variants[other]["exact"]["training_per_token"],
            "flops_ratio_paper": variants["recipe"]["paper"]["training_per_token"] / variants[other]["paper"]["training_per_token"],
        }
    return {
        "flop_convention": FLOP_CONVENTION,
        "seq_len": seq_len,
        "target_ratio": target,  # R of a dynamic segmentation (None otherwise)
        "realised_ratio": realised_ratio,  # the tokens per concept the FLOPs are counted at (None: R)
        "micro_batch_size": micro_batch,
        "global_batch_size": global_batch,
        "tokens_per_step": seq_len * global_batch,
        "variants": variants,
        "savings": savings,
    }


def config_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The few config fields a profile report needs to be read on its own."""
    keep = ("name", "backbone", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
            "padded_vocab_size", "n_token_layers", "extra_token_layers", "sliding_window")
    out = {k: getattr(cfg, k) for k in keep}
    out["concept"] = dataclasses.asdict(cfg.concept) if cfg.concept.enabled else None
    return out
