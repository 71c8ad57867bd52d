"""DLCM's learned, variable-length segments (``concept.segmentation: dynamic``): module.py (the
boundary predictor, pooling, decoding), config.py (its keys, its law, its cost). Its training hooks
(validation's tokens per concept) are ncpctl/train/designs/dynamic.py: they read the run's data."""
