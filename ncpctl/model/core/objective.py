"""The training objective: what the model is trained to predict (extension point ``model.objective``).

An ``Objective`` says, for one model:

* ``batch(window)``: how a data window (B, T+1) of consecutive tokens becomes the model's
  inputs (B, T) and targets (B, T) (-100 = no loss at that position); ``keyed_batch(window,
  sample_ids)``, what the training loop calls (training and validation), also gets each row's
  global sample index (B,): an objective whose noise is keyed on it (the same draws for a sample
  on any number of ranks and after a resume) overrides it; by default it is ``batch``;
* ``pattern(window)``: the attention pattern (patterns.py) of a token layer whose config gives it
  sliding window ``window`` (None: full); the attention layer maps it to the fastest kernel;
* ``loss(model, h, targets)``: the main loss from what the LM head reads h (B, T, d), named
  ``loss_key`` in ``NCPOutput.losses`` and in the logs (``log_keys``);
* ``score(context, continuation, max_len)``: how lm-eval's log-likelihood of a continuation is
  read from one forward: the input ids, the continuation tokens scored, and the position whose
  logits score each of them;
* ``decoding(model, tokens, lengths, max_len, interventions)``: how it generates: a ``Decoding``
  whose ``logits`` (B, V) pick each row's next token and whose ``step(tokens)`` feeds them;
* ``block_sampling``: True when ``generate`` samples it block by block (a diffusion LM:
  ncpctl/inference/causal_diffusion.py) instead of token by token through ``decoding``;
* ``refusal(what)``: why the objective cannot do ``what`` (``generate``, ``export``), or None:
  the commands ask it before they start;
* ``validation(model, window, sample_ids)`` / ``validation_record(sums)``: held-out estimates
  beyond the training loss (the CDLM's ELBO): the sums of one validation micro-batch, which the
  loop adds up over micro-batches, batches and ranks, then the record keys made from the totals;
  by default none (the validation loss is the training loss);
* ``bound``: whether its log-likelihoods are estimates of a bound (an ELBO), not exact; then
  ``loglikelihood_bounds`` answers lm-eval instead of ``score`` and the eval output says "bound";
* ``on_step_begin(step)`` (optional): the optimizer step, for schedules inside the objective;
* for the concept bottleneck (bottleneck.py): ``concept_positions(idx, targets)``, where its concept
  loss, held-out detection and a steering stage's injection read (None: every position);
  ``fed_labels(labels, chunk)``, what teacher forcing may feed each token; ``target_tokens(targets)``,
  the token ids the targets score (the concept share's logits).

``NextToken`` (the default, ``model.objective: next_token``) is next-token prediction, the only
place that knows the shift (targets[:, p] = window[:, p + 1]), with causal attention and decoding
on KV caches (``NCPModel.prefill`` / ``decode_step``). Another objective is registered with
``ncpctl.model.register("objective", name, cls)`` or named as ``package.module:Class`` (see
docs/architecture.md, "An objective"). ``causal`` says whether each position's output depends
on earlier positions only (its pattern is causal): then cached decoding is exact and scoring may
right-pad a batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ncpctl.model.core.outputs import LogKey
from ncpctl.model.core.patterns import Causal, Pattern


class Decoding:
    """Generation state of a batch: ``logits`` (B, V) of the token each row picks next; ``step``
    feeds the picked tokens (B,) and sets the next ``logits``."""

    logits: torch.Tensor

    def step(self, tokens: torch.Tensor) -> None:
        raise NotImplementedError


class CachedDecoding(Decoding):
    """Decoding on KV caches: ``model.prefill`` of the left-padded prompts, then one
    ``model.decode_step`` per token; ``pick`` selects, from the prefill's logits (B, Tp, V),
    the row logits of the first new token (next-token: the last slot, every row's last token)."""

    def __init__(self, model, tokens: torch.Tensor, lengths, max_len: int | None, interventions: Any = None,
                 pick=lambda logits: logits[:, -1]):
        logits, self.state = model.prefill(tokens, lengths, max_len=max_len, interventions=interventions)
        self.model, self.logits = model, pick(logits)

    def step(self, tokens: torch.Tensor) -> None:
        self.logits = self.model.decode_step(self.state, tokens)


class Objective:
    """Base of the training objectives; ``cfg`` is the model's ``ModelConfig``."""

    loss_key = "ntp_loss"
    causal = True  # each position sees earlier ones only: cached decoding exact, right padding harmless
    block_sampling = False  # generate samples block by block (inference/causal_diffusion.py), not via decoding
    bound = False  # log-likelihoods are exact (``score``), not Monte Carlo estimates of a bound

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def pattern(self, window: int | None) -> Pattern:
        return Causal(window)

    def batch(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def keyed_batch(self, window: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` of windows whose rows are the global samples ``sample_ids`` (B,)."""
        return self.batch(window)

    def refusal(self, what: str) -> str | None:
        """Why this objective cannot do ``what`` (a command: ``generate``, ``export``); None: it can."""
        return None

    def loss(self, model, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits or None, mean loss) of targets (B, T) from what the head reads, h (B, T, d):
        the fused LM head's cross-entropy (head.py: logits None while it will be differentiated)."""
        return model.head(h, targets)

    def log_keys(self) -> list[LogKey]:
        return [LogKey(self.loss_key)]

    def validation(self, model, window: torch.Tensor, sample_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Held-out estimates of one validation micro-batch ``window`` (B, T+1) on the model's device
        whose rows are the global samples ``sample_ids`` (B,): name -> a tensor that the loop sums over
        micro-batches, batches and ranks (every rank the same names and shapes). None by default."""
        return {}

    def validation_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The validation record's keys from the summed ``validation`` tensors."""
        return {}

    def loglikelihood_bounds(self, model, tokens: torch.Tensor, scored: torch.Tensor, *, samples: int, seed: int,
                             greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An objective whose ``bound`` is set: (each row's estimates (B, samples) of its bound on
        -log p of the ``scored`` (B, L) tokens of ``tokens`` (B, L), the row starting at position 0;
        with ``greedy`` whether each row's scored tokens are what the model would pick (B,) bool)."""
        raise NotImplementedError

    # ---- the concept bottleneck's hooks (the defaults are next-token prediction's) ----

    def concept_positions(self, idx: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) bool: the positions of inputs idx (B, T) where the bottleneck's concept loss and
        detection read and a steering stage injects; None: all of them."""
        return None

    def fed_labels(self, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        """Token labels (B, T, n) -> what teacher forcing may feed each token (B, T, n): the label
        of the chunk that closed before it (bottleneck.fed_labels)."""
        from ncpctl.model.designs.bottleneck.chunks import fed_labels

        return fed_labels(labels, chunk)

    def target_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """The token ids (B, T) that ``targets`` (as ``batch`` builds them) score, -100 = none."""
        return targets

    def score(self, context: Sequence[int], continuation: Sequence[int],
              max_len: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(input ids (at most ``max_len``), the continuation tokens scored (a continuation longer
        than the window: its last ones), the position whose logits score each of them)."""
        raise NotImplementedError

    def decoding(self, model, tokens: torch.Tensor, lengths, max_len: int | None,
                 interventions: Any = None) -> Decoding:
        raise NotImplementedError


class NextToken(Objective):
    """Next-token prediction: position p predicts token p + 1 (causal attention, the models of
    every shipped recipe)."""

    def batch(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return window[:, :-1], window[:, 1:]  # (B, T) inputs, next tokens

    def score(self, context, continuation, max_len):
        # context + continuation minus its last token, left-truncated to max_len like HFLM; a
        # continuation longer than the window: its last tokens
        seq = (list(context) + list(continuation))[-(max_len + 1):]
        inp = tuple(seq[:-1])
        cont = tuple(continuation)[len(continuation) - min(len(continuation), len(inp)):]
        return inp, cont, tuple(range(len(inp) - len(cont), len(inp)))

    def decoding(self, model, tokens, lengths, max_len, interventions=None) -> Decoding:
        return CachedDecoding(model, tokens, lengths, max_len, interventions)
