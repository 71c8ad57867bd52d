"""Sampling from NCP models on the incremental decoder (``ncpctl generate`` and lm-eval's
``generate_until``): greedy, temperature, top-k, top-p, stop strings, seeds, streaming."""

from ncpctl.inference.generate import Completion, SamplingParams, generate

__all__ = ["Completion", "SamplingParams", "generate"]
