"""DLCM's token-to-concept cross-attention (``concept.coupling: cross_attention``): module.py,
config.py (its keys and cost)."""
