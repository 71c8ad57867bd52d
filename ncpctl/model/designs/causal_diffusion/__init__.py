"""The Causal Diffusion LM (``model.objective: causal_diffusion``): module.py (the objective and its
held-out ELBO), sampler.py (block-wise sampling, shipped with exported code), config.py (its keys)."""
