"""What a run directory gives a fit beyond N, D, C and its validation losses (``read_run``):

* ``N_nonembedding``: the parameters without the embeddings and the LM head (tied weights once), and
  ``C_nonembedding``: the training FLOPs without the LM head's matmul (the embedding lookup costs
  none), the Kaplan et al. convention NCP-ArchPreview's C follows (``fit --exclude-embeddings``);
* ``epochs``: the training tokens over the tokens of the training split (repetition above 1);
* a concept path's ``R`` (tokens per concept: the realised mean of a learned segmentation, else the
  segmentation's own) and ``P`` (the concept transformer's share of the non-embedding parameters,
  DLCM's P), the columns of ``fit --dlcm``;
* a WSD decay branch's ``stable_NAME`` for each validation loss NAME measured at the stable-phase
  checkpoint it started from (``stable_loss``: the decay-phase law's L_stable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_columns(run: Path, recipe: Any, params: Any, steps: int, tokens: float,
                ratio: float | None) -> dict[str, float]:
    """The columns above of run directory ``run`` (its point's settings, beside its validation metrics).
    ``params``: its ``count_parameters``; ``steps`` and ``tokens``: what its last training record says;
    ``ratio``: its realised R."""
    from ncpctl.model.accounting.flops import TRAIN_MULTIPLIER, exact_flops

    cfg = recipe.model_config
    comps = params.components
    n_ne = params.total - comps["embeddings"] - comps["lm_head"]
    per_step = recipe.flops_per_step(realised_ratio=ratio)
    head = TRAIN_MULTIPLIER * recipe.global_batch_size * exact_flops(cfg, recipe.seq_len, 1).components["lm_head"]
    settings = {"N_nonembedding": float(n_ne), "C_nonembedding": float((per_step - head) * steps)}
    split = train_split_tokens(run, recipe)
    if split:
        settings["epochs"] = tokens / split
    if cfg.concept.enabled:
        settings["R"] = float(ratio if ratio is not None else cfg.tokens_per_concept)
        settings["P"] = comps["concept_layers"] / n_ne
    start = recipe.decay_start or {}
    for k, v in (start.get("val") or {}).items():
        if isinstance(v, (int, float)):
            settings[f"stable_{k}"] = float(v)
    return settings


def train_split_tokens(run: Path, recipe: Any) -> int | None:
    """The tokens of a run's training split: the ``meta.json`` beside it (``splits.train.tokens``: the run's
    own ``data/``, or ``data.train_prefix``'s directory), else the ``.bin``'s length; None for a mixture
    or data that is gone."""
    d = recipe.data
    if d.mix and not d.train_prefix:
        return None
    prefix = Path(d.train_prefix) if d.train_prefix else run / "data" / "train"
    try:
        meta = json.loads((prefix.parent / "meta.json").read_text())
        n = int(meta["splits"][prefix.name]["tokens"])
        return n if n > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.errors import UserError

    if not Path(f"{prefix}.bin").is_file():
        return None  # the data is gone: the epochs stay unknown
    try:
        return int(IndexedDataset(str(prefix)).num_tokens) or None
    except (UserError, OSError, ValueError):
        return None
