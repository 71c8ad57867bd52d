"""Issue 22: ``exact_flops`` equals torch's ``FlopCounterMode`` (forward and backward) for the design
of every shipped recipe, shrunk to the ``debug`` shape: its design keys kept (backbone, norms,
residual mixers, codebook, MTP, bottleneck, windows), its sizes replaced by debug's."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model import NCPModel
from ncpctl.model.accounting.flops import exact_flops
from ncpctl.model.core.config import ModelConfig, build_config
from ncpctl.recipe.load import _load_tree

from ..conftest import RECIPES

DEBUG = build_config("debug").to_dict()
T = 32  # tokens per sequence in the counted step


def _designs() -> dict[str, dict]:
    """One shrunk config per distinct design among the shipped recipes (recipe name -> config dict)."""
    out, seen = {}, set()
    for path in sorted(RECIPES.rglob("*.yaml")):
        tree = _load_tree(path, [], {}).get("model")
        if not isinstance(tree, dict) or "common" in path.stem:
            continue
        tree = dict(tree)
        try:
            cfg = build_config(tree.pop("size", "debug"), **tree)
        except Exception:  # a recipe whose model comes from its init_from checkpoint
            continue
        d = _shrink(cfg)
        key = repr(sorted((k, repr(v)) for k, v in d.items()))
        if key not in seen:
            seen.add(key)
            out[str(path.relative_to(RECIPES))] = d
    return out


def _shrink(cfg: ModelConfig) -> dict:
    d = cfg.to_dict()
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "pad_vocab_multiple"):
        d[k] = DEBUG[k]
    d["n_kv_heads"] = 2 if cfg.n_kv_heads < cfg.n_heads else None
    d["ffn_dim"], d["rope_scaling"] = None, None
    # a window as long as the test's T: the layers keep their window pattern, and SDPA's math kernel
    # (which computes the masked scores too) does the work exact_flops counts (windowed counts are
    # checked by hand in test_accounting.py)
    d["sliding_window"] = T if cfg.sliding_window else None
    d["extra_token_layers"] = min(cfg.extra_token_layers, 2)
    if cfg.extra_token_layers_at is not None:
        d["extra_token_layers_at"] = min(cfg.extra_token_layers_at, 2)
    d["mup_base_width"] = 32 if cfg.mup_base_width else None
    d["mup_base_concept_width"] = 64 if cfg.mup_base_concept_width else None
    c = d["concept"]
    c.update(encoder_layers=min(c["encoder_layers"], 1), concept_layers=min(c["concept_layers"], 2),
             segments=4, codes=min(c["codes"], 16), concept_heads=None, ffn_dim=None,
             d_concept=128 if cfg.concept_cfg.d_model != cfg.d_model else None)
    if isinstance(d.get("diffusion"), dict) and d["diffusion"].get("mask_id") is None:
        d["diffusion"]["mask_id"] = 1  # what tokenize gives [MASK] (after EOD); the loader reads it from the data
    b = d["bottleneck"]
    if b["enabled"]:
        b.update(concepts=8, unknown=None, rank=None, chunk=8)
        # top-k kept on, below the shrunk widths (8 known, 24 unknown)
        b.update({k: min(b[k], cap) for k, cap in (("top_k_known", 4), ("top_k_unknown", 12)) if b[k] is not None})
    return d


DESIGNS = _designs()


def test_the_shipped_designs_are_all_here():
    """The shrink keeps each recipe family's design: fixed blocks and DLCM's dynamic segments, the
    three backbones, IRC, CRC and Block AttnRes, MTP, the bottleneck and its steering stage."""
    cfgs = [ModelConfig.from_dict(d) for d in DESIGNS.values()]
    assert {c.backbone for c in cfgs} >= {"neox", "llama", "gpt2"}
    assert {c.concept.segmentation for c in cfgs if c.concept.enabled} >= {"fixed", "dynamic"}
    assert any(c.residual != "plain" and c.crc_connections for c in cfgs)
    assert {c.residual for c in cfgs} >= {"plain", "irc", "block_attnres"}
    assert any(c.mtp_depth for c in cfgs) and any(c.bottleneck.enabled for c in cfgs)
    assert any(c.bottleneck.express_weight > 0 for c in cfgs)


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_exact_flops_equal_torchs_counter_at_the_debug_shape(name):
    """One training forward + backward under FlopCounterMode (SDPA's math kernel: attention counted
    as matmuls) equals ``exact_flops``'s GEMM count (``gemm_training_per_step``: the elementwise and
    matrix-vector work, which torch does not count, left out), every parameter trained. What the data
    decide is counted as realised: DLCM's concepts (one sequence: M = the concepts it closed, as a
    ratio T / M) and the steering stage's injected positions. Only the ncp_code_acc metric's
    nearest-code search (a logged accuracy, not the model's work) is added by hand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    d = DESIGNS[name]
    if d["bottleneck"]["express_weight"] > 0:  # every row steered: the injection's cost is exercised
        d = {**d, "bottleneck": {**d["bottleneck"], "steer_fraction": 1.0}}
    cfg = ModelConfig.from_dict(d)
    model, B = NCPModel(cfg).train(), 1
    x = torch.randint(0, cfg.vocab_size, (B, T))
    kw, injected = {}, []
    if cfg.bottleneck.enabled:
        n = cfg.bottleneck.concepts
        kw["concept_labels"] = torch.rand(B, T, n) < 0.3
        if cfg.bottleneck.express_weight > 0:  # the loop sets lift tokens from the data; any will do
            model.bottleneck.lift = torch.randint(0, cfg.vocab_size, (n, cfg.bottleneck.lift_tokens))
            inject = model.bottleneck.injection

            def spy(*a, **k):  # the positions this step injects (drawn at random: the data's count)
                inj = inject(*a, **k)
                injected.append(int(inj.where.sum()))
                return inj

            model.bottleneck.injection = spy
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, x, **kw)
        out.loss.backward()
    ratio = T / out.pred.shape[1] if cfg.concept.enabled and cfg.law.variable_length else None
    e = exact_flops(cfg, T, B, trainable={k: v.numel() for k, v in model.named_parameters() if v.requires_grad},
                    realised_ratio=ratio, steered_positions=injected[0] if injected else None)
    assert not injected or injected[0] > 0
    metric = 0
    if cfg.concept.enabled:
        S, N, ds, M = cfg.n_segments, cfg.concept.codes, cfg.segment_dim, e.concept_positions
        metric = B * 2 * (M - 1) * S * N * ds
    assert counter.get_total_flops() == e.gemm_training_per_step() + metric
