"""DLCM decoding at random weights, for the decode benchmarks (``bench/dlcm_decode.py``,
``bench/gpu_check.py`` section 7): the DLCM model and its layer-matched and token-layer bases,
its inference threshold set for a compression ratio R, and the tokens per concept it realises.
"""

from __future__ import annotations

from pathlib import Path


def models(recipe: Path, d: int):
    """(bases, dlcm, cfg): ``recipe``'s DLCM model (``recipes/debug-dlcm.yaml``) at token width d with
    its concept width doubled, eval mode, its inference threshold calibrated for R (``calibrate_threshold``),
    and two bases with the concept path off: ``matched`` (as many token layers as DLCM has layers)
    and ``token`` (DLCM's encoder + decoder layers only). Random weights, seed 0."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe

    sets = [f"model.d_model={d}", f"model.concept.d_concept={2 * d}", f"model.n_heads={max(1, d // 64)}",
            f"model.n_kv_heads={max(1, d // 64)}", f"model.concept.concept_heads={max(1, 2 * d // 64)}",
            f"model.ffn_dim={4 * d}", "model.max_seq_len=1024", "model.mup_base_width=null"]
    r = load_recipe(recipe, sets)
    cfg = r.model_config
    torch.manual_seed(0)
    dlcm = calibrate_threshold(NCPModel(cfg).eval(), cfg.concept.target_ratio)
    plain = {**cfg.to_dict(), "concept": {**cfg.to_dict()["concept"], "enabled": False}}
    bases = {}
    for name, n in (("matched", cfg.n_token_layers + cfg.concept.concept_layers), ("token", cfg.n_token_layers)):
        torch.manual_seed(0)
        bases[name] = NCPModel(type(cfg).from_dict({**plain, "n_layers": n})).eval()
    return bases, dlcm, cfg


def calibrate_threshold(model, R: float, B: int = 4, T: int = 256):
    """Set the model's inference boundary threshold to the (1 - 1/R) quantile of the boundary
    probabilities p it gives on random tokens, so about 1/R of the tokens start a segment (the
    rate the balance loss trains a model to). Returns the model."""
    import torch

    seg = model.concept.segmenter
    seen = {}
    hook = seg.register_forward_pre_hook(lambda _m, args: seen.setdefault("h", args[0]))
    x = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(11))
    try:
        with torch.no_grad():
            model(x, compute_logits=False)
            p = seg.probabilities(seen["h"])[:, 1:].float().flatten()  # p_0 = 1 is not a decision
    finally:
        hook.remove()
    seg.threshold = float(torch.quantile(p, 1 - 1 / R))
    return model


def tokens_per_concept(model, B: int, T: int) -> float:
    import torch

    dev = next(model.parameters()).device
    x = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(7)).to(dev)
    with torch.no_grad():
        m = model(x, x).metrics
    v = m.get("tokens_per_concept")
    return float(v) if v is not None else float("nan")
