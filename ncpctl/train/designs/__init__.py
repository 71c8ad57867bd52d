"""The training hooks of the shipped designs (``ncpctl.train.hooks``), one module per design:
what each adds to a run beyond its forward, beside nothing else.

``bottleneck``  Steerling's concept bottleneck: concept labels in, held-out detection AUC out,
                the steering stage's lift tokens, the label names in the checkpoint.
``dynamic``     DLCM's learned segments: validation's tokens per concept per source, the
                compression plot's target ratio.
``codebook``    the concept codebook: per-segment code hits of the final validation for the
                codebook-usage plot (``train.plots``).
"""
