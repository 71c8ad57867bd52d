"""Block-wise sampling from a Causal Diffusion LM (``model.objective: causal_diffusion``, issue 23
item 3): what ``generate`` runs for an objective with ``block_sampling`` (diffusion.py), and what an
exported CDLM's ``model.generate`` runs (interop/remote/modeling_ncp.py: this module travels with
the model package, so it imports nothing outside it).

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

Hooks, honoured alike with and without the cache:

* ``interventions`` (interventions.py) apply by position in every forward, to every slot the
  forward computes (a finished block's keys and values are computed with them too);
* ``steer`` (Steerling's steering, ``ncpctl.interpret.steer.BlockSteering``): at each forward,
  ``steer.interventions(where, committed)`` gives interventions restricted to ``where`` (B, n) bool,
  the slots of that forward that are still [MASK] (Steerling's ``_position_injection``), for rows
  that have committed ``committed[b]`` tokens so far; ``steer.adjust(b, committed, logits)`` edits
  row b's logits (n, V) before sampling (Steerling's ReLU logit mask);
* ``on_commit(Commit)``: every group of tokens a row commits at one step, with the model's logit
  of each (what attribution decomposes: ``ncpctl.interpret.trace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ncpctl.model.core.decode import _caches
from ncpctl.model.core.interventions import readout_addition
from ncpctl.model.core.patterns import step_masks
from ncpctl.model.core.slots import slot_states


def filter_logits(logits: torch.Tensor, p: Any) -> torch.Tensor:
    """Temperature, top-k and top-p (``p``: ``SamplingParams``) on logits (B, V); removed entries -inf."""
    logits = logits.float() / p.temperature
    V = logits.shape[-1]
    if p.top_k and p.top_k < V:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # mass before this token already >= top_p
        drop[:, 0] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


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


@dataclass
class Commit:
    """Tokens row ``row`` committed at one denoising step: ``positions`` (its own positions, 0 = its
    first prompt token), ``tokens``, the model's ``logits`` of those tokens at that step (before any
    steering adjustment of the sampler), ``committed`` = its tokens committed before this step,
    ``step`` = its denoising steps before this one."""

    row: int
    positions: list[int]
    tokens: list[int]
    logits: list[float]
    committed: int
    step: int


class _Cached:
    """Block logits on KV caches: each call runs the slots not yet cached (the finished blocks
    since the last call, clean) plus the current block, and caches them."""

    def __init__(self, model, x: torch.Tensor, pad: torch.Tensor):
        B, T = x.shape
        dtype = model.embed.weight.dtype
        self.model, self.pad, self.done = model, pad, 0  # done: slots [0, done) are cached and clean
        self.caches = (_caches(model.cfg, len(model.encoder), B, T, x.device, dtype),
                       _caches(model.cfg, len(model.decoder), B, T, x.device, dtype))

    def __call__(self, x: torch.Tensor, lo: int, S: int, ivs: Sequence[Any] = (),
                 holes: torch.Tensor | None = None, steer: Any = None, committed: Sequence[int] = ()) -> torch.Tensor:
        model, a, end = self.model, self.done, lo + S
        slots = torch.arange(end, device=x.device)
        k_pos = slots[None] - self.pad[:, None]  # (B, end): each row's own positions (padding < 0)
        q_pos = k_pos[:, a:]  # (B, end - a)
        ivs = list(ivs) + (steer.interventions(holes[:, a:end], committed) if steer is not None else [])
        masks = step_masks(model.token_patterns, q_pos, k_pos, k_pos >= 0)
        hN = slot_states(model, x[:, a:end], q_pos.clamp_min(0), masks, caches=self.caches, at=a, length=end,
                         ivs=ivs, iv_positions=q_pos)
        self.done = lo  # the blocks before the current one are now cached (the current one is not final)
        if not ivs:
            return model.head(model.readout(hN[:, -S:])[0])  # (B, S, V)
        return model.head(readout_addition(ivs, model.readout(hN)[0], q_pos)[:, -S:])


class _Recompute:
    """Block logits from a full forward of each row's sequence (positions 0 .. the block's end),
    rows right-padded with [MASK] by whole blocks, which no real position sees."""

    def __init__(self, model, x: torch.Tensor, pad: torch.Tensor):
        self.model, self.pad = model, pad.tolist()

    def __call__(self, x: torch.Tensor, lo: int, S: int, ivs: Sequence[Any] = (),
                 holes: torch.Tensor | None = None, steer: Any = None, committed: Sequence[int] = ()) -> torch.Tensor:
        model, B = self.model, x.shape[0]
        n = lo + S - min(self.pad)
        seq = torch.full((B, n), model.objective.mask_id, dtype=x.dtype, device=x.device)
        where = torch.zeros(B, n, dtype=torch.bool, device=x.device)  # the still-[MASK] slots to generate
        for b, p in enumerate(self.pad):
            seq[b, : lo + S - p] = x[b, p : lo + S]
            if holes is not None:
                where[b, : lo + S - p] = holes[b, p : lo + S]
        ivs = list(ivs) + (steer.interventions(where, committed) if steer is not None else [])
        if ivs:  # the full forward applies them (the readout's too): read its logits
            logits = model(seq, interventions=ivs).logits  # (B, n, V)
            return torch.stack([logits[b, lo - p : lo - p + S] for b, p in enumerate(self.pad)])
        hN = model(seq, compute_logits=False, return_hidden=True).hidden  # (B, n, d)
        h = torch.stack([hN[b, lo - p : lo - p + S] for b, p in enumerate(self.pad)])  # (B, S, d)
        return model.head(model.readout(h)[0])


def _commit(blk: torch.Tensor, open_: torch.Tensor, logits: torch.Tensor, counts: list[int], p: Any,
            gens: list, mask_id: int, vocab: int, adjust: Callable | None = None) -> list[tuple]:
    """Sample every open (still [MASK]) position ``open_`` (B, S) of each row of the block blk (B, S)
    from logits (B, S, V) and write the counts[b] most confident samples into blk (closing them).
    ``adjust(b, logits (n, V))``: row b's logits before sampling. Returns, per row that committed,
    (b, the block offsets committed, their tokens, the model's logits of those tokens)."""
    out = []
    for b, k in enumerate(counts):
        if k == 0:
            continue  # no draw: a row's random stream does not depend on the others
        where = open_[b].nonzero()[:, 0]  # (n,)
        raw = logits[b, where, :vocab].float()  # (n, V')
        lg = raw if adjust is None else adjust(b, raw)
        if mask_id < vocab:
            lg = lg.clone() if lg is raw else lg
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
        out.append((b, where[pick].tolist(), tok[pick].tolist(), raw[pick, tok[pick]].tolist()))
    return out


def _layout(prompts: Sequence[Sequence[int]], S: int, n_new: int, mask_id: int, dev) -> tuple:
    """(x (B, T) slots: left padding, the prompt, [MASK]s; pad per row; C; blocks each row needs;
    holes (B, T) bool: the positions to generate)."""
    B, lens = len(prompts), [len(t) for t in prompts]
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
    return x, pad, C, need, holes


@torch.inference_mode()
def sample_blocks(model, prompts: Sequence[Sequence[int]], params: Any, *, vocab_size: int | None = None,
                  cache: bool = True, on_block: Callable[[list[list[int]]], list[bool]] | None = None,
                  on_forward: Callable[[], None] | None = None, interventions: Sequence[Any] = (),
                  steer: Any = None, on_commit: Callable[[Commit], None] | None = None) -> list[list[int]]:
    """Each prompt's ``max_new_tokens`` new tokens (fewer if ``on_block`` stopped it). After each
    block, ``on_block(new)`` gets each row's new tokens of that block (position order; [] for rows
    already finished) and returns which rows are finished. ``cache``: KV-cached blocks, else a full
    recomputation every step; ``on_forward()`` is called once per forward (counting);
    ``interventions``, ``steer``, ``on_commit``: the module docstring's hooks."""
    ob = model.objective
    S, mask_id = ob.block, ob.mask_id
    vocab = vocab_size or model.cfg.padded_vocab_size
    steps, n_new, B = params.steps_per_block or S, params.max_new_tokens, len(prompts)
    dev = model.embed.weight.device
    x, pad, C, need, holes = _layout(prompts, S, n_new, mask_id, dev)
    gens: list = [None] * B
    if params.seed is not None:
        gens = [torch.Generator(device=dev).manual_seed(params.seed + b) for b in range(B)]
    fwd = (_Cached if cache else _Recompute)(model, x, torch.tensor(pad, device=dev))
    out: list[list[int]] = [[] for _ in range(B)]
    finished, committed, taken = [False] * B, [0] * B, [0] * B  # taken: each row's denoising steps
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
            logits = fwd(x, lo, S, interventions, holes, steer, committed)
            if on_forward is not None:
                on_forward()
            adjust = None if steer is None else (lambda b, lg: steer.adjust(b, committed[b], lg))
            for b, offs, toks, lgs in _commit(blk, open_, logits, counts, params, gens, mask_id, vocab, adjust):
                if on_commit is not None:
                    on_commit(Commit(b, [lo + o - pad[b] for o in offs], toks, lgs, committed[b], taken[b]))
                committed[b] += len(toks)
            taken = [t + (c > 0) for t, c in zip(taken, counts)]
        new = [blk[b, max(0, pad[b] + len(prompts[b]) - lo):].tolist() if live[b] else [] for b in range(B)]
        for b in range(B):
            out[b] += new[b]
        if on_block is not None:
            finished = [f or g for f, g in zip(finished, on_block(new))]
        if all(finished[b] or k + 1 >= need[b] for b in range(B)):
            break
    return [o[:n_new] for o in out]
