"""Decoupled muP learning rates (``model.mup``; DLCM Sec. 6.1): module.py, config.py."""
