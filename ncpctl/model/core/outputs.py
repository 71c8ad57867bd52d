"""What a forward hands back, and how the training loop learns what to log.

``NCPOutput`` carries named dicts instead of fixed fields, so a design with its own loss
terms, metrics or global statistics plugs in without the loop knowing it:

* ``losses``: unweighted scalar loss terms (``ntp_loss`` first, then the concept path's);
  ``loss`` is their weighted sum (the weights are recipe keys);
* ``metrics``: detached tensors, scalar or per element (``(S,)`` per codebook segment);
* ``stats``: local *sums* whose totals must be global over ranks and accumulation steps
  (the loop sums them over micro-batches, all-reduces them and hands the totals to
  ``NCPModel.on_step_end``: the per-step hook).

``NCPModel.log_keys()`` declares, when the model is built, every key the loop logs with its
size, in a fixed order: every rank packs the same vector, so one collective reduces all of
them. Torch-free, so the CLI can describe keys without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LogKey:
    """One logged quantity: ``size`` packed elements (their mean is logged as ``name``) and,
    with ``per``, the elements themselves as ``f"{name}_per_{per}"`` (e.g. per segment);
    ``train_only``: the model computes it in training mode only (not in validation records)."""

    name: str
    size: int = 1
    per: str | None = None
    train_only: bool = False


@dataclass
class NCPOutput:
    """Forward result. ``loss``/``losses`` are empty without targets.

    ``logits`` (B, T, padded_vocab_size) is None when a loss that will be differentiated is
    computed (targets given, grad enabled): the fused LM head then reuses the logits' memory
    for their gradient (head.py). Run under ``torch.no_grad()`` or without targets to get them.
    """

    logits: Any | None
    loss: Any | None = None  # sum of weight * term over ``losses``
    losses: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    concept: Any | None = None  # ConceptOutput: pred, code weights, segments (None without the path)
    hidden: Any | None = None  # (B, T, d) final-norm states, when asked for (``return_hidden``)
    # with ``return_states``: {"encoder", "concept", "decoder"} -> each stack's input and every
    # layer's output (a list of n_layers + 1 tensors; concept: None when no concept closed)
    states: dict[str, Any] | None = None
    # with ``return_bottleneck``: the concept bottleneck's parts (bottleneck.BottleneckOutput)
    bottleneck: Any | None = None

    # ---- named views (the spec's vocabulary; None when the model does not produce them) ----
    @property
    def ntp_loss(self):
        return self.losses.get("ntp_loss")

    @property
    def ncp_loss(self):
        return self.losses.get("ncp_loss")

    @property
    def vq_loss(self):
        return self.losses.get("vq_loss")

    @property
    def commitment_loss(self):  # commitment x ||c - sg(q)||^2: no gradient, logged apart from vq_loss
        return self.losses.get("commitment_loss")

    @property
    def code_usage(self):  # (S,) fraction of codes used per segment
        return self.metrics.get("code_usage")

    @property
    def code_perplexity(self):  # (S,) perplexity of code usage
        return self.metrics.get("code_perplexity")

    @property
    def ncp_code_acc(self):  # (S,) nearest code of pred == that of the true next concept
        return self.metrics.get("ncp_code_acc")

    @property
    def pred(self):  # (B, M, d) predicted next concepts
        return None if self.concept is None else self.concept.pred
