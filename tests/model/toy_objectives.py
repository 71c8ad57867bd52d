"""Toy training objectives built only through ncpctl's public extension point (``ncpctl.model``:
``Objective``, ``register``, the attention patterns): no file under ncpctl/ knows them.

* ``TwoAhead`` (``two_ahead``): position p predicts token p + 2, with causal attention. Its model
  is causal, so it decodes on KV caches like next-token prediction; only which logits pick a new
  token differ (token L is read at position L - 2: the prefill's second-to-last slot first).
* ``MaskedBlocks`` (``masked_blocks``): a tiny masked-token objective over blocks of
  ``BLOCK`` positions with a block-causal attention pattern (bidirectional inside a block, causal
  across blocks). Training masks the tail of each block (from a random cut on) with the token
  ``MASK`` (the first padded-vocabulary row, which no text produces) and predicts the masked
  tokens; generation appends masks to the end of the current block and reads the first one,
  one full forward per token (the pattern lets a position see later ones: no KV caches).

Importable by path (``tests.model.toy_objectives:TwoAhead``) for recipes run by the real CLI.
"""

from __future__ import annotations

import torch

from ncpctl.model import BlockCausal, CachedDecoding, Decoding, Objective, register

BLOCK = 4


class TwoAhead(Objective):
    loss_key = "two_ahead_loss"

    def batch(self, window):  # (B, T+1) -> inputs (B, T), targets (B, T): token p + 2, none for the last
        x = window[:, :-1]
        y = torch.full_like(x, -100)
        y[:, :-1] = window[:, 2:]
        return x, y

    def score(self, context, continuation, max_len):
        # seq[k] is read at position k - 2 (a first token after a 1-token context: at position 0)
        seq = (list(context) + list(continuation))[-(max_len + 2):]
        inp = tuple(seq[:-2]) if len(seq) > 2 else tuple(seq[:1])
        n = min(len(continuation), len(seq) - 1)
        cont = tuple(continuation)[len(continuation) - n:]
        return inp, cont, tuple(max(k - 2, 0) for k in range(len(seq) - n, len(seq)))

    def decoding(self, model, tokens, lengths, max_len, interventions=None):
        return TwoAheadDecoding(model, tokens, lengths, max_len, interventions)


class TwoAheadDecoding(CachedDecoding):
    """Token L (the first new one) from position L - 2, token L + 1 from L - 1 (both in the
    prefill), then each from the decoding step two tokens back."""

    def __init__(self, model, tokens, lengths, max_len, interventions=None):
        keep = {}

        def pick(logits):  # (B, Tp, V): a 1-token prompt has no position L - 2: its last slot serves
            short = torch.tensor([n < 2 for n in lengths], device=logits.device)
            keep["next"] = logits[:, -1]
            return torch.where(short[:, None], logits[:, -1], logits[:, -2 if logits.shape[1] > 1 else -1])

        super().__init__(model, tokens, lengths, max_len, interventions, pick=pick)
        self.pending = keep["next"]

    def step(self, tokens):
        self.logits, self.pending = self.pending, self.model.decode_step(self.state, tokens)


class MaskedBlocks(Objective):
    loss_key = "masked_loss"
    causal = False  # a position sees the rest of its block

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.padded_vocab_size <= cfg.vocab_size:
            raise ValueError("masked_blocks needs a spare padded-vocabulary row for its mask token "
                             "(raise model.pad_vocab_multiple)")
        self.mask_id = cfg.vocab_size

    def pattern(self, window):
        return BlockCausal(BLOCK, window)

    def batch(self, window):  # (B, T+1): the last token is not used
        x = window[:, :-1].clone()
        B, T = x.shape
        pos = torch.arange(T, device=x.device)
        cut = torch.randint(0, BLOCK, (B, (T + BLOCK - 1) // BLOCK), device=x.device)  # per block
        masked = (pos % BLOCK)[None] >= cut.repeat_interleave(BLOCK, dim=1)[:, :T]  # (B, T)
        y = torch.where(masked, x, torch.full_like(x, -100))
        return x.masked_fill(masked, self.mask_id), y

    def score(self, context, continuation, max_len):
        # the continuation masked, all of it read in one forward
        n = len(continuation)
        inp = (list(context) + [self.mask_id] * n)[-max_len:]
        n = min(n, len(inp) - 1) if len(inp) > 1 else n
        return tuple(inp), tuple(continuation)[len(continuation) - n:], tuple(range(len(inp) - n, len(inp)))

    def decoding(self, model, tokens, lengths, max_len, interventions=None):
        if interventions:
            raise ValueError("masked_blocks: interventions are not supported")
        return MaskedDecoding(model, self.mask_id, [t[t.shape[0] - n:].tolist() for t, n in zip(tokens, lengths)])


class MaskedDecoding(Decoding):
    """One full forward per new token: each row's tokens so far, then masks to the end of the
    current block; the first mask's logits pick the token."""

    def __init__(self, model, mask_id: int, rows: list[list[int]]):
        self.model, self.mask_id, self.rows = model, mask_id, rows
        self._forward()

    def _forward(self) -> None:
        dev = self.model.embed.weight.device
        out = []
        for r in self.rows:  # alone: right padding would be seen inside a block
            n = len(r)
            x = torch.tensor(r + [self.mask_id] * (BLOCK - n % BLOCK), device=dev)[None]
            out.append(self.model(x).logits[0, n])
        self.logits = torch.stack(out)

    def step(self, tokens):
        for r, t in zip(self.rows, tokens.tolist()):
            r.append(t)
        self._forward()


register("objective", "two_ahead", TwoAhead)
register("objective", "masked_blocks", MaskedBlocks)
