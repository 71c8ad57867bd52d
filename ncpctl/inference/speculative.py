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

Ragged acceptance: each row keeps its own accepted prefix. Rows share one slot axis (left
padding, decode.py) but each has its own next slot (``DecodeState.behind``): a round feeds the
same K + 1 tokens to every row, each row from its own slot, and a row that kept fewer tokens
simply writes its next round over its rejected slots (they are later than any of its queries,
so they are never visible meanwhile). The last round of a row may emit more tokens than it has
left; the extra ones are dropped (a cut decided before they are drawn: exact) and not counted in
the statistics (MAL counts committed tokens only, as Eq. 27).

Rollback: the token KV caches need only each row's write slot moved back; concept caches
likewise (a concept index past a row's closed count is masked); the segmenter's, coupling's
and CRC's per-row state is restored, row by row, from the snapshot the multi-token step took
after the row's last kept token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ncpctl.model.core.decode import restore, snapshot, step_many

from .generate import Rows, SamplingParams, filter_logits


@dataclass
class SpecStats:
    """Acceptance over the verification rounds of a run (MAL: NCP-ArchPreview Eq. 27, tokens
    committed per round, the target's correction or bonus token included), counted per row."""

    rounds: int = 0  # verification rounds (target forwards after the prefill)
    row_rounds: int = 0  # (round, running row) pairs
    committed: int = 0  # tokens committed, summed over (round, running row)
    drafted: int = 0  # drafted tokens, summed over (round, running row)
    hist: dict[int, int] = field(default_factory=dict)  # tokens committed in a (round, row) -> how often

    def record(self, per_row: list[int], k: int) -> None:
        """One round: the tokens each running row committed (accepted drafts + 1; fewer where a row reached
        max_new_tokens or its end inside the round), K drafted."""
        self.rounds += 1
        self.row_rounds += len(per_row)
        self.committed += sum(per_row)
        self.drafted += k * len(per_row)
        for n in per_row:
            self.hist[n] = self.hist.get(n, 0) + 1

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.row_rounds += other.row_rounds
        self.committed += other.committed
        self.drafted += other.drafted
        for n, c in other.hist.items():
            self.hist[n] = self.hist.get(n, 0) + c

    def as_dict(self) -> dict:
        return {"rounds": self.rounds,
                "mal": self.committed / self.row_rounds if self.row_rounds else None,
                "acceptance": (self.committed - self.row_rounds) / self.drafted if self.drafted else None,
                "committed_per_round": {str(n): self.hist[n] for n in sorted(self.hist)}}


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
    """A model's cached decoding of a batch that can feed several tokens at once and roll each row
    back to any of the tokens fed since the last ``commit`` (or to the commit itself)."""

    def __init__(self, model, tokens: torch.Tensor, lengths: list[int], max_len: int, interventions=None):
        logits, self.state = model.prefill(tokens, lengths, max_len=max_len, interventions=interventions)
        self.model, self.logits = model, logits[:, -1]  # (B, V) the first new token's
        self._mark()

    def _mark(self) -> None:
        self.base, self.snaps, self.fed = self.state.row_slots, [snapshot(self.state)], 0

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, n) -> logits (B, n, V); ``state.hidden`` holds their final-norm states."""
        self.fed += tokens.shape[1]
        return step_many(self.model, self.state, tokens, self.snaps)

    def commit(self, keep: list[int]) -> None:
        """Keep row b's first ``keep[b]`` tokens fed since the last commit; forget the rest."""
        if not all(0 <= k <= self.fed for k in keep):
            raise ValueError(f"keep must be in [0, {self.fed}], got {keep}")
        if any(k < self.fed for k in keep):
            restore(self.state, [self.snaps[k] for k in keep], [b + k for b, k in zip(self.base, keep)])
        self._mark()


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


def speculate(model, spec: Speculative, tokens: torch.Tensor, lengths: list[int], params: SamplingParams,
              gens: list, rows: Rows, **kw) -> None:
    """Generate ``params.max_new_tokens`` per row of the left-padded prompts tokens (B, Tp) into
    ``rows``, drafting with ``spec.drafter`` and verifying on ``model`` (keywords: ``_speculate``'s).
    A drafter that reads the target's states hooks it for this call only (``attach``, before the
    prefill; ``detach`` after, also on an error)."""
    spec.drafter.attach(model)
    try:
        _speculate(model, spec, tokens, lengths, params, gens, rows, **kw)
    finally:
        spec.drafter.detach()


@torch.no_grad()
def _speculate(model, spec: Speculative, tokens: torch.Tensor, lengths: list[int], params: SamplingParams,
               gens: list, rows: Rows, *, vocab_size: int | None = None, interventions=None,
               logit_adjust: Callable | None = None) -> None:
    B, Tp = tokens.shape
    n_new = params.max_new_tokens
    # a row's slots: its prompt, up to n_new - 1 + K fed and kept tokens, a round's K + 1 fed ones
    capacity = Tp + n_new + 2 * spec.k + 1
    target = Cursor(model, tokens, lengths, capacity, interventions)
    drafter = spec.drafter
    drafter.start(target, tokens, lengths, capacity)

    def dist(logits: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """Logits (B, V) of row b's new token ``steps[b]`` -> the target's p (B, V)."""
        logits = logits if vocab_size is None else logits[:, :vocab_size]
        if logit_adjust is not None:  # it takes one step for the batch: once per distinct step
            out = logits.clone()
            for step in set(steps):
                at = torch.tensor([s == step for s in steps], device=logits.device)
                out[at] = logit_adjust(step, logits)[at]
            logits = out
        return probs(logits, params)

    p0 = dist(target.logits, [0] * B)
    x = [draw(p0[b], params, g) for b, g in enumerate(gens)]
    for b in range(B):
        rows.push(b, x[b])
    produced = [1] * B  # new tokens per row so far
    while True:
        running = [b for b in range(B) if not rows.done[b] and produced[b] < n_new]
        if not running:
            break
        K = min(spec.k, max(n_new - produced[b] for b in running), drafter.max_tokens or spec.k)
        x_t = torch.tensor(x, device=tokens.device)
        drafts, q = drafter.propose(x_t, K, params, gens, vocab_size)  # (B, K), (B, K, V)
        logits = target.feed(torch.cat([x_t[:, None], drafts], 1))  # (B, K+1, V)
        p = torch.stack([dist(logits[:, i], [n + i for n in produced]) for i in range(K + 1)], 1)  # (B, K+1, V)
        d_host = drafts.tolist()
        emitted = [verify(p[b], d_host[b], q[b], params, gens[b], spec.accept) if b in running else [x[b]]
                   for b in range(B)]
        # x, then the accepted drafts; a row that stopped keeps nothing (it stays where it is)
        keep = [len(emitted[b]) if b in running else 0 for b in range(B)]
        target.commit(keep)
        drafter.commit(keep)
        before = [len(rows.out[b]) for b in running]
        for b in running:
            for t in emitted[b][: n_new - produced[b]]:
                rows.push(b, t)
            produced[b] += len(emitted[b])
        # Eq. 27 counts the tokens a round commits: not those dropped past max_new_tokens or an end
        spec.stats.record([len(rows.out[b]) - n for b, n in zip(running, before)], K)
        x = [e[-1] for e in emitted]
