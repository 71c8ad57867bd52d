"""What sampling is asked for and what it gives back, shared by next-token generation (generate.py),
the block-wise sampler (causal_diffusion.py) and speculative decoding (speculative.py): the
``SamplingParams``, each row's ``Completion``, the rows of a batch as they grow (``Rows``: stop
strings, end of document, streaming), and the prompt fitting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` (or ``greedy``) is argmax."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens (None/0: all)
    top_p: float | None = None  # keep the smallest set with probability >= top_p (None/1: all)
    greedy: bool = False
    seed: int | None = None  # None: torch's global RNG
    stop: list[str] = field(default_factory=list)
    # block-wise sampling (an objective with ``block_sampling``: causal_diffusion; causal_diffusion.py)
    steps_per_block: int | None = None  # denoising steps per block (None: the block size, one token a step)
    commit_per_step: int | None = None  # commit at most this many tokens a step (None: the linear schedule)

    def __post_init__(self) -> None:
        for key in ("steps_per_block", "commit_per_step"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ValueError(f"{key} must be >= 1, got {v}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


@dataclass
class Completion:
    text: str  # generated text, cut before the first stop string
    tokens: list[int]  # generated token ids (up to and including the stopping token)
    finish_reason: str  # "stop" (stop string), "eod" (end of document), "length"


def releasable(text: str, final: bool, stop: Sequence[str], shown: int) -> int:
    """How much of a row's ``text`` may be streamed: all of it once ``final``, else all but what a
    stop string or an unfinished UTF-8 sequence may still change (never less than ``shown``)."""
    safe = len(text) if final else len(text) - max([len(s) - 1 for s in stop] + [0])
    while safe > shown and text[safe - 1] == "\ufffd":
        safe -= 1
    return max(safe, shown)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class Rows:
    """The new tokens and text of each row of a batch: end-of-document and stop strings end a row
    (``done[b]``: its finish reason, None while it runs); ``on_text(row, delta)`` streams text as
    it becomes final."""

    def __init__(self, B: int, stop: Sequence[str], decode: Callable[[list[int]], str], eod_id: int | None,
                 on_text: Callable[[int, str], None] | None):
        self.stop, self.decode, self.eod_id, self.on_text = stop, decode, eod_id, on_text
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.texts = [""] * B
        self.shown = [0] * B
        self.done: list[str | None] = [None] * B

    def push(self, b: int, token: int) -> None:
        """Append ``token`` to row b (nothing once the row is done)."""
        if self.done[b]:
            return
        out = self.out[b]
        out.append(token)
        if self.eod_id is not None and token == self.eod_id:
            self.done[b] = "eod"
            out_text = self.decode(out[:-1])
        else:
            out_text = self.decode(out)
        cut, hit = cut_at_stop(out_text, self.stop)
        if hit:
            self.done[b] = "stop"
        self.texts[b] = cut
        if self.on_text is not None:
            safe = releasable(cut, bool(self.done[b]), self.stop, self.shown[b])
            if safe > self.shown[b]:
                self.on_text(b, cut[self.shown[b]:safe])
                self.shown[b] = safe

    def finish(self) -> list[Completion]:
        return finish_rows(self.texts, self.out, self.done, self.shown, self.on_text)


def finish_rows(texts: Sequence[str], tokens: Sequence[list[int]], done: Sequence[str | None], shown: Sequence[int],
                on_text: Callable[[int, str], None] | None) -> list[Completion]:
    """Each row's completion (a row still running when sampling ends finished by ``length``), after
    ``on_text`` streams the rest of its text, what was held back (``shown[b]``: characters streamed)."""
    result = []
    for b, text in enumerate(texts):
        if on_text is not None and len(text) > shown[b]:
            on_text(b, text[shown[b]:])
        result.append(Completion(text, tokens[b], done[b] or "length"))
    return result


def fit_prompts(prompts: Sequence[Sequence[int]], max_len: int, n_new: int) -> list[list[int]]:
    """The last ``max_len - n_new`` tokens of each prompt (at least one), so that a prompt and its
    new tokens fit ``max_len``."""
    keep = max(1, max_len - n_new)
    return [list(t)[-keep:] for t in prompts]
