"""Block-wise sampling from a Causal Diffusion LM (``model.objective: causal_diffusion``, issue 23
item 3): what ``generate`` runs for an objective with ``block_sampling`` (model/diffusion.py).

Prompt tokens hold positions 0..L-1. Generation first fills the rest of the block that contains
position L (the prompt's tail stays fixed, the other positions start as [MASK]), then whole new
blocks, one at a time, until every row has ``max_new_tokens`` new tokens (or has stopped); the
output is cut to ``max_new_tokens``. Inside a block, ``steps_per_block`` denoising steps (default:
the block size): each step runs the block with the earlier blocks as context, samples a token at
every still-masked position (temperature / top-k / top-p as next-token sampling, greedy = argmax;
never [MASK] nor a padded-vocab id) and commits the most confident ones (confidence = the
probability of the sampled token: LLaDA's low-confidence remasking). How many per step: a linear
schedule (the block's masked count spread evenly over its steps, earlier steps taking the
remainder, as Steerling's ``_get_num_transfer_tokens``) or ``commit_per_step`` K at most per step;
the last step commits all that remain.

Caching (``cache=True``): generation blocks are aligned to the MODEL's blocks (position // block),
so a finished block is never recomputed: its clean tokens' keys/values enter the KV caches in the
first step of the next block, whose forward runs [finished block | new block] (exact: under
block-causal attention the finished block does not see the new one). Steerling's public sampler
(guidelabs/steerling ``steerling/inference/causal_diffusion.py``) instead recomputes the whole
sequence at every step and starts its generation blocks right after the prompt, not on the
model's block boundaries. ``cache=False`` is that recomputation (the reference the tests compare
with): every step is a full forward of each row's sequence from position 0.

Batching is exact: row b is left-padded by a whole number of blocks, ``(C - L_b // block) *
block`` slots (C = the largest number of complete prompt blocks), so every row's current block
occupies the same slots; padding keys are masked out and positions are each row's own (as
decode.py). Row b samples with its own ``torch.Generator`` (``seed + b``) and draws only at the
steps where it commits, so a prompt's output does not depend on the other rows of its batch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ncpctl.model.decode import _caches, _encode
from ncpctl.model.layers import Context, rope
from ncpctl.model.patterns import step_masks

from .generate import Completion, SamplingParams, _cut, filter_logits, finish_rows, fit_prompts, releasable


def schedule(masked: int, steps: int, per_step: int | None) -> list[int]:
    """Tokens committed at each of ``steps`` steps of a block with ``masked`` [MASK] positions: a
    linear schedule (``per_step`` None) or at most ``per_step`` a step; the last step commits the rest."""
    if per_step is None:
        base, rem = divmod(masked, steps)
        return [base + (i < rem) for i in range(steps)]
    out, left = [], masked
    for i in range(steps):
        n = left if i == steps - 1 else min(per_step, left)
        out.append(n)
        left -= n
    return out


class _Cached:
    """Block logits on KV caches: each call runs the slots not yet cached (the finished blocks
    since the last call, clean) plus the current block, and caches them."""

    def __init__(self, model, x: torch.Tensor, pad: torch.Tensor):
        B, T = x.shape
        dtype = model.embed.weight.dtype
        self.model, self.pad, self.done = model, pad, 0  # done: slots [0, done) are cached and clean
        self.enc = _caches(model.cfg, len(model.encoder), B, T, x.device, dtype)
        self.dec = _caches(model.cfg, len(model.decoder), B, T, x.device, dtype)

    def __call__(self, x: torch.Tensor, lo: int, S: int) -> torch.Tensor:
        model, a, end = self.model, self.done, lo + S
        slots = torch.arange(end, device=x.device)
        k_pos = slots[None] - self.pad[:, None]  # (B, end): each row's own positions (padding < 0)
        q_pos = k_pos[:, a:]  # (B, end - a)
        positions = q_pos.clamp_min(0)
        h = model.embed_tokens(x[:, a:end], positions)  # (B, end - a, d)
        cos, sin = rope(positions, model.cfg, h.dtype)
        masks = step_masks(model.token_patterns, q_pos, k_pos, k_pos >= 0)
        ctx = Context(cos, sin, masks, at=a, length=end)
        h, depths = _encode(model, h, ctx.with_(caches=self.enc))
        hN = model.decode(h, model.decoder_crc(ctx.with_(caches=self.dec), depths, None))
        self.done = lo  # the blocks before the current one are now cached (the current one is not final)
        return model.head(model.readout(hN[:, -S:])[0])  # (B, S, V)


class _Recompute:
    """Block logits from a full forward of each row's sequence (positions 0 .. the block's end),
    rows right-padded with [MASK] by whole blocks, which no real position sees."""

    def __init__(self, model, x: torch.Tensor, pad: torch.Tensor):
        self.model, self.pad = model, pad.tolist()

    def __call__(self, x: torch.Tensor, lo: int, S: int) -> torch.Tensor:
        model, B = self.model, x.shape[0]
        n = lo + S - min(self.pad)
        seq = torch.full((B, n), model.objective.mask_id, dtype=x.dtype, device=x.device)
        for b, p in enumerate(self.pad):
            seq[b, : lo + S - p] = x[b, p : lo + S]
        hN = model(seq, compute_logits=False, return_hidden=True).hidden  # (B, n, d)
        h = torch.stack([hN[b, lo - p : lo - p + S] for b, p in enumerate(self.pad)])  # (B, S, d)
        return model.head(model.readout(h)[0])


def _commit(blk: torch.Tensor, open_: torch.Tensor, logits: torch.Tensor, counts: list[int], p: SamplingParams,
            gens: list, mask_id: int, vocab: int) -> None:
    """Sample every open (still [MASK]) position ``open_`` (B, S) of each row of the block blk (B, S)
    from logits (B, S, V) and write the counts[b] most confident samples into blk (closing them)."""
    for b, k in enumerate(counts):
        if k == 0:
            continue  # no draw: a row's random stream does not depend on the others
        where = open_[b].nonzero()[:, 0]  # (n,)
        lg = logits[b, where, :vocab].float()  # (n, V')
        if mask_id < vocab:
            lg[:, mask_id] = float("-inf")
        if p.is_greedy:
            conf, tok = lg.softmax(-1).max(-1)  # (n,) each
        else:
            probs = filter_logits(lg, p).softmax(-1)
            tok = torch.multinomial(probs, 1, generator=gens[b])[:, 0]
            conf = probs.gather(1, tok[:, None])[:, 0]
        pick = conf.topk(min(k, len(where))).indices
        blk[b, where[pick]] = tok[pick]
        open_[b, where[pick]] = False


@torch.inference_mode()
def sample_blocks(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *, vocab_size: int | None = None,
                  cache: bool = True, on_block: Callable[[list[list[int]]], list[bool]] | None = None,
                  on_forward: Callable[[], None] | None = None) -> list[list[int]]:
    """Each prompt's ``max_new_tokens`` new tokens (fewer if ``on_block`` stopped it). After each
    block, ``on_block(new)`` gets each row's new tokens of that block (position order; [] for rows
    already finished) and returns which rows are finished. ``cache``: KV-cached blocks, else a full
    recomputation every step; ``on_forward()`` is called once per forward (counting)."""
    ob = model.objective
    S, mask_id = ob.block, ob.mask_id
    vocab = vocab_size or model.cfg.padded_vocab_size
    steps = params.steps_per_block or S
    n_new, B = params.max_new_tokens, len(prompts)
    dev = model.embed.weight.device
    lens = [len(t) for t in prompts]
    C = max(n // S for n in lens)  # complete prompt blocks of the longest row
    pad = [(C - n // S) * S for n in lens]
    # blocks row b needs: the rest of its prompt's last block, then whole blocks
    need = [1 + max(0, -(-(n_new - (S - n % S)) // S)) for n in lens]
    x = torch.full((B, (C + max(need)) * S), mask_id, dtype=torch.long, device=dev)
    for b, t in enumerate(prompts):
        x[b, pad[b] : pad[b] + lens[b]] = torch.tensor(list(t), dtype=torch.long)
    # the positions to generate (a [MASK] the prompt itself holds stays as given)
    holes = torch.arange(x.shape[1], device=dev)[None] >= torch.tensor(pad, device=dev)[:, None] + \
        torch.tensor(lens, device=dev)[:, None]  # (B, T)
    gens: list = [None] * B
    if params.seed is not None:
        gens = [torch.Generator(device=dev).manual_seed(params.seed + b) for b in range(B)]
    fwd = (_Cached if cache else _Recompute)(model, x, torch.tensor(pad, device=dev))
    out: list[list[int]] = [[] for _ in range(B)]
    finished = [False] * B
    for k in range(max(need)):
        lo = (C + k) * S
        blk, open_ = x[:, lo : lo + S], holes[:, lo : lo + S]  # views: commits write into x and holes
        live = [not finished[b] and k < need[b] for b in range(B)]
        plans = [schedule(int(open_[b].sum()), steps, params.commit_per_step) if live[b] else [0] * steps
                 for b in range(B)]
        for i in range(steps):
            counts = [plan[i] for plan in plans]
            if not any(counts):
                continue  # nothing to commit: the forward would change nothing
            logits = fwd(x, lo, S)
            if on_forward is not None:
                on_forward()
            _commit(blk, open_, logits, counts, params, gens, mask_id, vocab)
        new = [blk[b, max(0, pad[b] + lens[b] - lo):].tolist() if live[b] else [] for b in range(B)]
        for b in range(B):
            out[b] += new[b]
        if on_block is not None:
            finished = [f or g for f, g in zip(finished, on_block(new))]
        if all(finished[b] or k + 1 >= need[b] for b in range(B)):
            break
    return [o[:n_new] for o in out]


def generate_blocks(model, prompts: Sequence[Sequence[int]], params: SamplingParams,
                    decode: Callable[[list[int]], str], *, eod_id: int | None = None, vocab_size: int | None = None,
                    max_len: int | None = None, on_text: Callable[[int, str], None] | None = None,
                    interventions: Sequence[Any] | None = None, logit_adjust: Any = None,
                    cache: bool = True) -> list[Completion]:
    """``generate`` for a block-sampling objective: the same arguments and completions. EOD ends a
    row at the end of its block (text cut before it); stop strings cut as next-token sampling does
    (checked token by token); ``on_text`` streams each row's text once per committed block;
    ``max_len`` keeps the last ``max_len // block * block - max_new_tokens`` prompt tokens."""
    if interventions or logit_adjust is not None:
        raise ValueError(f"objective {model.cfg.objective}: interventions and steering are not implemented for "
                         "block-wise sampling yet")
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

    sample_blocks(model, prompts, params, vocab_size=vocab_size, cache=cache, on_block=on_block)
    return finish_rows(texts, toks, done, shown, on_text)

