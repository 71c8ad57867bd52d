"""Steerling's concept bottleneck (``model.bottleneck``): module.py (the bottleneck), chunks.py (its
chunk arithmetic), sparse.py (top-k heads, attribution), config.py (its keys and cost). Its training
hooks (labels in, detection AUC out) are ncpctl/train/designs/bottleneck.py: they read the run's data."""
