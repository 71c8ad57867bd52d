"""Sampling from NCP models on the incremental decoder (``ncpctl generate`` and lm-eval's
``generate_until``): greedy, temperature, top-k, top-p, stop strings, seeds, streaming."""

from ncpctl.inference.generate import Completion, SamplingParams, eod_token, generate, generate_texts

__all__ = ["Completion", "SamplingParams", "eod_token", "generate", "generate_texts"]
