"""``generate`` for a Causal Diffusion LM (``model.objective: causal_diffusion``): text, stop strings,
EOD and streaming around the block-wise sampler (ncpctl/model/designs/causal_diffusion/sampler.py, which also travels
with an exported CDLM: its docstring says how blocks are sampled, cached and batched, and which
hooks steering and attribution use).

Steering (``ncpctl generate --steer`` on a CDLM: ``ncpctl.interpret.steer.BlockSteering``) adds its
direction at the still-[MASK] positions of each forward, as Steerling's generator does;
``interventions`` apply by position in every forward.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ncpctl.model.designs.causal_diffusion.sampler import Commit, _Cached, _commit, _Recompute, sample_blocks, schedule

from .generate import Completion, SamplingParams, _cut, finish_rows, fit_prompts, releasable

__all__ = ["Commit", "_Cached", "_Recompute", "_commit", "generate_blocks", "sample_blocks", "schedule"]


def generate_blocks(model, prompts: Sequence[Sequence[int]], params: SamplingParams,
                    decode: Callable[[list[int]], str], *, eod_id: int | None = None, vocab_size: int | None = None,
                    max_len: int | None = None, on_text: Callable[[int, str], None] | None = None,
                    interventions: Sequence[Any] | None = None, logit_adjust: Any = None,
                    cache: bool = True, steer: Any = None,
                    on_commit: Callable[[Any], None] | None = None) -> list[Completion]:
    """``generate`` for a block-sampling objective: the same arguments and completions. EOD ends a
    row at the end of its block (text cut before it); stop strings cut as next-token sampling does
    (checked token by token); ``on_text`` streams each row's text once per committed block;
    ``max_len`` keeps the last ``max_len // block * block - max_new_tokens`` prompt tokens;
    ``interventions`` apply by position in every forward; ``steer`` and ``on_commit``: the block
    sampler's hooks. ``logit_adjust`` (next-token decoding's, by generated token) is refused: a block
    commits its tokens in confidence order, so ``steer.adjust`` edits a row's logits instead."""
    if logit_adjust is not None:
        raise ValueError(f"objective {model.cfg.objective}: logit_adjust(step, logits) is for next-token decoding; "
                         "block-wise sampling takes its steering as steer (ncpctl.interpret.steer.BlockSteering)")
    S, n_new = model.objective.block, params.max_new_tokens
    prompts = [list(t) for t in prompts]
    if max_len is not None:
        prompts = fit_prompts(prompts, max_len // S * S, n_new)
    if n_new == 0:
        return [Completion("", [], "length") for _ in prompts]
    B = len(prompts)
    toks: list[list[int]] = [[] for _ in range(B)]
    texts, shown = [""] * B, [0] * B
    done: list[str | None] = [None] * B

    def take(b: int, new: list[int]) -> None:
        for t in new:
            if done[b] or len(toks[b]) == n_new:
                return
            toks[b].append(t)
            eod = eod_id is not None and t == eod_id
            texts[b], hit = _cut(decode(toks[b][:-1] if eod else toks[b]), params.stop)
            done[b] = "eod" if eod else "stop" if hit else None

    def on_block(new: list[list[int]]) -> list[bool]:
        for b in range(B):
            take(b, new[b])
            cut = texts[b]
            if on_text is not None:  # hold back what a stop string or an unfinished UTF-8 sequence may change
                safe = releasable(cut, done[b] is not None, params.stop, shown[b])
                if safe > shown[b]:
                    on_text(b, cut[shown[b]:safe])
                    shown[b] = safe
        return [d is not None for d in done]

    sample_blocks(model, prompts, params, vocab_size=vocab_size, cache=cache, on_block=on_block,
                  interventions=model.check_interventions(interventions), steer=steer, on_commit=on_commit)
    return finish_rows(texts, toks, done, shown, on_text)

