"""Speculative decoding (draft and verify) for ``generate``: exact, several tokens per target forward.

Each round a drafter (drafters.py) proposes K tokens d_1..d_K after the pending token x (the
last committed token, not yet fed to the target); the target feeds [x, d_1, ..., d_K] in one
cached forward (``decode.step_many``), which gives its distributions p_0..p_K, and the standard
rejection rule (Leviathan et al. 2023; Chen et al. 2023) keeps a prefix:

* d_i is accepted with probability min(1, p_{i-1}(d_i) / q_i(d_i)) (q_i: the drafter's
  distribution, after the same temperature / top-k / top-p filter);
* at the first rejection the correction is drawn from norm(max(0, p_{i-1} - q_i));
* if all K are accepted, a bonus token is drawn from p_K.

Every emitted token is then distributed as the target's next token given the tokens before it,
so the output distribution is the target's; greedy (q and p one-hot) accepts d_i iff it is the
target's argmax and emits exactly the plain greedy tokens.

Ragged acceptance: rows share one slot axis (left padding, decode.py), so a round commits the
same number of tokens m = min over running rows of (accepted_b + 1) to every row; a row that
accepted more keeps only its first m tokens. That stays exact: whether a row's i-th token is
kept is decided before it is drawn (by earlier acceptances and by other rows, whose randomness
is their own), so every kept token is a target sample given the tokens before it, and the next
round draws afresh. The cost is drafted tokens thrown away in batches; ``SpecStats`` reports
both the committed MAL and the per-row one a per-row commit would reach.

Rollback: the token KV caches need only the write slot moved back (entries past it are never
read before they are written again); concept caches likewise (a concept index past a row's
closed count is masked); the segmenter's, coupling's and CRC's per-row state is restored from
the snapshot the multi-token step took after the last kept token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ncpctl.model.decode import restore, step_many

from .generate import Rows, SamplingParams, filter_logits


@dataclass
class SpecStats:
    """Acceptance over the verification rounds of a run (MAL: NCP-ArchPreview Eq. 27, tokens
    committed per round, the target's correction or bonus token included)."""

    rounds: int = 0
    committed: int = 0  # tokens committed per row, summed over rounds (the same m for every running row)
    row_rounds: int = 0  # (round, running row) pairs
    row_accepted: int = 0  # accepted drafts + 1 summed over (round, running row): a per-row commit's tokens
    drafted: int = 0  # drafted tokens per row, summed over rounds

    def record(self, m: int, per_row: list[int], k: int) -> None:
        self.rounds += 1
        self.committed += m
        self.row_rounds += len(per_row)
        self.row_accepted += sum(per_row)
        self.drafted += k

    def as_dict(self) -> dict:
        return {"rounds": self.rounds,
                "mal": self.committed / self.rounds if self.rounds else None,
                "mal_per_row": self.row_accepted / self.row_rounds if self.row_rounds else None,
                "acceptance": (self.committed - self.rounds) / self.drafted if self.drafted else None}


@dataclass
class Speculative:
    """What ``generate`` needs to speculate: a drafter (drafters.py), K drafted tokens per round,
    and the statistics it accumulates. ``accept`` (tests only) replaces the acceptance rule:
    f(p(d) (,), q(d) (,)) -> probability of accepting d."""

    drafter: Any
    k: int = 4
    stats: SpecStats = field(default_factory=SpecStats)
    accept: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"draft tokens K must be >= 1, got {self.k}")


class Cursor:
    """A model's cached decoding of a batch that can feed several tokens at once and roll back to
    any of the tokens fed since the last ``commit``."""

    def __init__(self, model, tokens: torch.Tensor, lengths: list[int], max_len: int, interventions=None):
        logits, self.state = model.prefill(tokens, lengths, max_len=max_len, interventions=interventions)
        self.model, self.logits = model, logits[:, -1]  # (B, V) the first new token's
        self.base, self.snaps = self.state.slot, []

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, n) -> logits (B, n, V); ``state.hidden`` holds their final-norm states."""
        return step_many(self.model, self.state, tokens, self.snaps)

    @property
    def fed(self) -> int:
        """Tokens fed since the last ``commit``."""
        return self.state.slot - self.base

    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` tokens fed since the last commit; forget the rest."""
        if not 0 <= keep <= self.fed:
            raise ValueError(f"keep must be in [0, {self.fed}], got {keep}")
        if keep < self.fed:
            if keep == 0:
                raise ValueError("rolling back to before the last commit is not kept track of")
            restore(self.state, self.snaps[keep - 1], self.base + keep)
        self.base, self.snaps = self.state.slot, []


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution (B, V) of logits (B, V), as the plain sampler draws from it
    (greedy: one-hot on the argmax)."""
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits, params).softmax(-1)


def draw(p: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one row's distribution p (V,)."""
    if params.is_greedy:
        return int(p.argmax())
    return int(torch.multinomial(p[None], 1, generator=gen)[0, 0])


def verify(p: torch.Tensor, drafts: list[int], q: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           accept: Callable | None = None) -> list[int]:
    """One row: target distributions p (K+1, V), drafts d_1..d_K and the drafter's q (K, V) ->
    the tokens to emit: the accepted drafts and the correction (or the bonus token)."""
    out = []
    for i, d in enumerate(drafts):
        if params.is_greedy:
            ok = int(p[i].argmax()) == d
        else:
            prob = (p[i, d] / q[i, d]).clamp(max=1.0) if accept is None else accept(p[i, d], q[i, d])
            ok = bool(torch.rand((), generator=gen, device=p.device) < prob)
        if not ok:
            rest = (p[i] - q[i]).clamp_min(0.0)  # norm(max(0, p - q)); p == q leaves nothing: draw from p
            return out + [draw(rest / rest.sum() if rest.sum() > 0 else p[i], params, gen)]
        out.append(d)
    return out + [draw(p[len(drafts)], params, gen)]


@torch.no_grad()
def speculate(model, spec: Speculative, tokens: torch.Tensor, lengths: list[int], params: SamplingParams,
              gens: list, rows: Rows, *, vocab_size: int | None = None, interventions=None,
              logit_adjust: Callable | None = None) -> None:
    """Generate ``params.max_new_tokens`` per row of the left-padded prompts tokens (B, Tp) into
    ``rows``, drafting with ``spec.drafter`` and verifying on ``model``."""
    B, Tp = tokens.shape
    n_new = params.max_new_tokens
    target = Cursor(model, tokens, lengths, Tp + n_new, interventions)
    drafter = spec.drafter
    drafter.start(target, tokens, lengths, Tp + n_new)

    def dist(logits: torch.Tensor, step: int) -> torch.Tensor:  # (B, V) -> the target's p (B, V)
        logits = logits if vocab_size is None else logits[:, :vocab_size]
        return probs(logits if logit_adjust is None else logit_adjust(step, logits), params)

    p0 = dist(target.logits, 0)
    x = [draw(p0[b], params, g) for b, g in enumerate(gens)]
    for b in range(B):
        rows.push(b, x[b])
    produced = 1
    while produced < n_new and not all(rows.done):
        # a round emits at most K + 1 tokens; the last round's extra ones are dropped (a cut decided
        # before they are drawn: exact)
        K = min(spec.k, n_new - produced, drafter.max_tokens or spec.k)
        x_t = torch.tensor(x, device=tokens.device)
        drafts, q = drafter.propose(x_t, K, params, gens, vocab_size)  # (B, K), (B, K, V)
        logits = target.feed(torch.cat([x_t[:, None], drafts], 1))  # (B, K+1, V)
        p = torch.stack([dist(logits[:, i], produced + i) for i in range(K + 1)], 1)  # (B, K+1, V)
        d_host = drafts.tolist()
        emitted = [verify(p[b], d_host[b], q[b], params, g, spec.accept) if not rows.done[b] else [0] * (K + 1)
                   for b, g in enumerate(gens)]
        running = [len(e) for b, e in enumerate(emitted) if not rows.done[b]]
        m = min(running)
        spec.stats.record(m, running, K)
        target.commit(m)  # x, d_1 .. d_{m-1}
        drafter.commit(m)
        for b in range(B):
            for t in emitted[b][: min(m, n_new - produced)]:
                rows.push(b, t)
        x = [e[m - 1] for e in emitted]
        produced += m
