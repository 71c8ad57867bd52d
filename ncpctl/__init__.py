"""ncpctl: train and study Next Concept Prediction (NCP) language models."""

__version__ = "0.1.0"
