"""Batched generation (spec section 5), as the model's objective decodes (``Objective.decoding``).

Prompts are left-padded into one batch; the objective's ``Decoding`` gives each row's logits of
its next token and is fed the picked tokens. Next-token prediction runs the prompts once through
``model.prefill`` and then one token per step through ``model.decode_step`` (KV caches, per-row
concept-block phase), so a ConceptLM sees exactly the tokens a full forward would; on CUDA those
steps replay one captured CUDA graph (cuda_graphs.py). Each row samples with its own
``torch.Generator`` seeded ``seed + row``: a prompt's output does not depend on which other
prompts share its batch, and the same seed gives the same text.

An objective with ``block_sampling`` (the Causal Diffusion LM) is sampled block by block instead
(causal_diffusion.py), with the same arguments, seeds, stop strings and completions.

Stop strings are checked on the decoded text of the new tokens; the text returned ends
before the first stop string (lm-eval's ``until`` semantics). The end-of-document token
always stops a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ncpctl.model.designs.causal_diffusion.sampler import filter_logits  # noqa: F401  (next-token sampling shares it)
from ncpctl.model.core.objective import CachedDecoding

from . import cuda_graphs


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


def _pick(logits: torch.Tensor, p: SamplingParams, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Next token per row (B,) from logits (B, V)."""
    if p.is_greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, p).softmax(-1)
    return torch.cat([torch.multinomial(probs[b : b + 1], 1, generator=g)[0] for b, g in enumerate(gens)])


def releasable(text: str, final: bool, stop: Sequence[str], shown: int) -> int:
    """How much of a row's ``text`` may be streamed: all of it once ``final``, else all but what a
    stop string or an unfinished UTF-8 sequence may still change (never less than ``shown``)."""
    safe = len(text) if final else len(text) - max([len(s) - 1 for s in stop] + [0])
    while safe > shown and text[safe - 1] == "\ufffd":
        safe -= 1
    return max(safe, shown)


def _cut(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    decode: Callable[[list[int]], str],
    *,
    eod_id: int | None = None,
    vocab_size: int | None = None,
    max_len: int | None = None,
    on_text: Callable[[int, str], None] | None = None,
    interventions: Sequence[Any] | None = None,
    logit_adjust: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    speculative: Any = None,
    steer: Any = None,
) -> list[Completion]:
    """Continue each prompt (token ids, at least one each). ``decode`` turns ids into text
    (for stop strings and streaming); ``vocab_size`` hides padded-vocab rows; ``max_len``
    keeps only the last ``max_len - max_new_tokens`` prompt tokens; ``on_text(row, delta)``
    streams new text as it becomes final; ``interventions`` (``ncpctl.model.core.interventions``:
    rows are this batch's rows, positions each row's own) apply to the prompt and every new token;
    ``logit_adjust(step, logits (B, V))`` edits the logits that pick new token ``step`` (0-based);
    ``speculative`` (a ``speculative.Speculative``): a drafter proposes tokens that the model
    verifies several at a time, with the same output distribution (greedy: the same tokens);
    ``steer``: a block-sampling objective's steering (``ncpctl.interpret.steer.BlockSteering``)."""
    B = len(prompts)
    if B == 0:
        return []
    if any(len(t) == 0 for t in prompts):
        raise ValueError("every prompt needs at least one token")
    if getattr(model.objective, "block_sampling", False):  # a diffusion LM: block by block
        if speculative is not None:
            raise ValueError(f"speculative decoding needs next-token decoding; objective {model.cfg.objective} "
                             "samples block by block")
        from .causal_diffusion import generate_blocks

        return generate_blocks(model, prompts, params, decode, eod_id=eod_id, vocab_size=vocab_size, max_len=max_len,
                               on_text=on_text, interventions=interventions, logit_adjust=logit_adjust, steer=steer)
    if steer is not None:
        raise ValueError("steer is block-wise sampling's; next-token decoding takes interventions and logit_adjust")
    if params.steps_per_block is not None or params.commit_per_step is not None:
        raise ValueError(f"steps_per_block / commit_per_step apply to block-wise sampling (objective: "
                         f"causal_diffusion), not to objective {model.cfg.objective}")
    n_new = params.max_new_tokens
    prompts = [list(t) for t in prompts]
    if max_len is not None:
        prompts = fit_prompts(prompts, max_len, n_new)
    if n_new == 0:
        return [Completion("", [], "length") for _ in prompts]
    dev = model.embed.weight.device
    lengths = [len(t) for t in prompts]
    Tp = max(lengths)
    x = torch.zeros(B, Tp, dtype=torch.long, device=dev)
    for b, t in enumerate(prompts):
        x[b, Tp - len(t):] = torch.tensor(t, dtype=torch.long)
    gens: list[torch.Generator | None] = [None] * B
    if params.seed is not None:
        gens = [torch.Generator(device=dev).manual_seed(params.seed + b) for b in range(B)]
    rows = Rows(B, params.stop, decode, eod_id, on_text)
    if speculative is not None:  # draft and verify (speculative.py)
        from .speculative import speculate

        speculate(model, speculative, x, lengths, params, gens, rows, vocab_size=vocab_size,
                  interventions=interventions, logit_adjust=logit_adjust)
        return rows.finish()
    dec = model.objective.decoding(model, x, lengths, Tp + n_new, interventions)
    if isinstance(dec, CachedDecoding) and cuda_graphs.wanted(x.device):  # one CUDA graph per decode step
        dec = cuda_graphs.GraphedDecoding(dec)
    last = dec.logits  # (B, V): each row's next token
    for step in range(n_new):
        if vocab_size is not None:
            last = last[:, :vocab_size]
        if logit_adjust is not None:
            last = logit_adjust(step, last)
        nxt = _pick(last, params, gens)  # (B,)
        ids = nxt.tolist()
        for b in range(B):
            rows.push(b, ids[b])
        if all(rows.done) or step == n_new - 1:
            break
        dec.step(nxt)
        last = dec.logits
    return rows.finish()


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
        cut, hit = _cut(out_text, self.stop)
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


def eod_token(loaded) -> tuple[str, int | None]:
    """The end-of-document token of a loaded checkpoint (its recipe's ``tokenizer.eod_token``,
    default ``<|endoftext|>``) and its id in the checkpoint's tokenizer (None if absent)."""
    token = ((loaded.meta.get("recipe") or {}).get("tokenizer") or {}).get("eod_token", "<|endoftext|>")
    return token, (loaded.tokenizer.token_to_id(token) if loaded.tokenizer is not None else None)


def generate_texts(loaded, prompts: Sequence[str], params: SamplingParams, *, batch_size: int = 8,
                   on_text: Callable[[int, str], None] | None = None,
                   steer: Sequence[Sequence[Any]] | None = None, speculative: Any = None) -> list[Completion]:
    """Text in, completions out, for a ``LoadedModel`` (``ncpctl generate``): prompts are
    encoded with the checkpoint's tokenizer (an empty prompt = the end-of-document token)
    and decoded ``batch_size`` at a time; prompt i samples with ``seed + i``, so its text
    does not depend on the batch size; ``on_text(i, delta)`` streams prompt i's text;
    ``steer[i]``: prompt i's ``ncpctl.interpret.steer.Resolved`` specs; ``speculative``: draft and
    verify (``speculative.Speculative``, its statistics summed over the batches)."""
    from ncpctl.errors import UserError

    tok = loaded.tokenizer
    if tok is None:
        raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint")
    _, eod = eod_token(loaded)
    encoded = [tok.encode(p, add_special_tokens=False).ids or ([eod] if eod is not None else []) for p in prompts]
    if any(not e for e in encoded):
        raise UserError("an empty prompt needs an end-of-document token in the tokenizer")
    out: list[Completion] = []
    for s in range(0, len(encoded), batch_size):
        cb = None if on_text is None else (lambda row, delta, s=s: on_text(s + row, delta))
        # prompt i samples with seed + i whatever the batch size (generate seeds row b with seed + b)
        p = params if params.seed is None else replace(params, seed=params.seed + s)
        batch = fit_prompts(encoded[s : s + batch_size], loaded.config.max_seq_len, params.max_new_tokens)
        ivs = adjust = blocks = None
        if steer is not None and getattr(loaded.model.objective, "block_sampling", False):
            from ncpctl.interpret.steer import block_steering  # at the [MASK] positions, by committed tokens

            blocks = block_steering(steer[s : s + batch_size])
        elif steer is not None:  # positions count from each (fitted) prompt's first token
            from ncpctl.interpret.steer import interventions_for, logit_adjuster

            ivs = interventions_for(steer[s : s + batch_size], [len(t) for t in batch])
            adjust = logit_adjuster(steer[s : s + batch_size])
        out += generate(loaded.model, batch, p,
                        lambda ids: tok.decode(ids, skip_special_tokens=False), eod_id=eod,
                        vocab_size=loaded.config.vocab_size, max_len=loaded.config.max_seq_len, on_text=cb,
                        interventions=ivs, logit_adjust=adjust, speculative=speculative, steer=blocks)
    return out
