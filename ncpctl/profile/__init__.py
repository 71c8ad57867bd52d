"""Where every FLOP and second goes: the library behind ``ncpctl profile-kernels`` (issue #6).

Sections (each a function returning a JSON-ready dict; ``run.profile`` runs the chosen ones):

* ``accounting``: parameters by component and training FLOPs per token / per step for the
  recipe and its base and PM siblings, paper view and exact view (``ncpctl.model.accounting.flops``).
* ``kernels``: timed micro-benchmarks (token vs concept layer, SDPA backends, the concept
  path's pooling/heads/codebook, the DLCM cross-attention trick over a grid).
* ``step``: one full training step (fwd+bwd+AdamW), achieved FLOP/s vs a measured GEMM peak
  (CPU) or the known bf16 peak (GPU).
* ``trace``: a ``torch.profiler`` Chrome trace of a few steps and its top operators.
* ``ops`` (only when named): aten operators launched per training step and per decode step, of the
  recipe's model and its plain sibling, per layer (``ops``: host overhead a CPU can count).

Shared with the training loop and ``bench/``: ``timing`` (timing, paired ratios, the GEMM peak and
the one table of GPU peaks), ``step`` (random batches, one training step with or without a
DeepSpeed engine) and ``dlcm`` (the DLCM decode benchmark's models).

Model code stays free of timing and I/O (style rule 3): everything here wraps it from outside.
"""

SECTIONS = ("accounting", "kernels", "step", "trace", "ops")
DEFAULT_SECTIONS = SECTIONS[:4]  # ``ops`` counts on CPU models of the recipe's shape: asked for by name
