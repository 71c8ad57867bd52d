"""Issue 22: ``exact_flops`` equals torch's ``FlopCounterMode`` (forward + backward, every parameter
trained) for every design of the generic design tests (tests/model/test_designs.py): the shipped
designs in their tiny shapes and the toys added only through the public extension points, whose
own work each toy reports through its ``cost`` attribute (tests/model/toys.py), the toy
objectives (tests/model/toy_objectives.py) and the Causal Diffusion LM (block-causal attention)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ncpctl.model.accounting.flops import exact_flops

from ._helpers import build
from .test_designs import DESIGNS
from .test_diffusion import cdlm
from .test_objectives import MASKED, TWO, TWO_CONCEPT

T, B = 16, 1
CASES = {**DESIGNS, "toy-objective-two-ahead": TWO, "toy-objective-two-ahead-alternating": TWO_CONCEPT,
         "toy-objective-masked-blocks": MASKED, "causal-diffusion": cdlm()}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_flops_equal_torchs_counter(name):
    """SDPA's math kernel counts attention as matmuls over every key, so a sliding window is
    widened to T here (the layers keep their window pattern): exact_flops counts a window as the
    windowed kernel a GPU runs (min(T, window) keys per query; by hand in test_accounting.py).
    The GEMM count (``gemm_training_per_step``) leaves out the elementwise and matrix-vector work
    torch does not count; a data-dependent segmentation is counted at the concepts it realised
    (one sequence: the ratio T / M); the ncp_code_acc metric's nearest-code search (a logged
    accuracy) is added by hand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = CASES[name]
    if cfg.sliding_window:
        cfg = dataclasses.replace(cfg, sliding_window=T)
    torch.manual_seed(0)
    model = build(cfg, scale=0.3).train()
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, x)
        out.loss.backward()
    M = out.pred.shape[1] if out.pred is not None else 0
    ratio = T / M if cfg.concept.enabled and cfg.law.variable_length else None
    e = exact_flops(cfg, T, B, realised_ratio=ratio,
                    trainable={k: v.numel() for k, v in model.named_parameters() if v.requires_grad})
    assert e.concept_positions == M
    metric = 0
    if cfg.concept.enabled:
        S, N, ds = cfg.n_segments, cfg.concept.codes, cfg.segment_dim
        metric = B * 2 * (M - 1) * S * N * ds
    assert counter.get_total_flops() == e.gemm_training_per_step() + metric
