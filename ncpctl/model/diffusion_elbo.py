"""The held-out ELBO of a Causal Diffusion LM (diffusion.py; issue 23 item 4): a Monte Carlo
estimate of an upper bound on the negative log-likelihood, the CDLM's validation loss
(``val/diffusion_elbo``) and the log-likelihood ``ncpctl eval`` gives lm-eval for a CDLM.

The CDLM generates block by block, each block from the CLEAN earlier blocks (as its sampler
conditions), so -log p(x) = sum_j -log p(x_j | x_<j), and each block's term is bounded by the
masked-diffusion ELBO (MDLM: absorbing [MASK] noise, the linear schedule, continuous time) over the
n scored positions of block j::

    -log p(x_j | x_<j) <= E_{t ~ U(0,1)} E_{M ~ Bernoulli(t)^n} [ (1/t) sum_{i in M} -log p_theta(x_i | x_<j, x_j with M masked) ]

Positions of the block that are not scored stay visible (a continuation that starts inside a block
after its context: LLaDA's conditional form, the context clean, the continuation noised).
Given |M| = k, M is uniform over the k-subsets of the n positions, and integrating t out,
C(n, k) * integral of t^(k-1) (1-t)^(n-k) dt over (0, 1) = C(n, k) B(k, n-k+1) = 1/k, so the bound is
exactly::

    sum_{k=1..n} (1/k) E_{|M| = k} [ sum_{i in M} -log p_theta(x_i | ...) ]

which is LLaDA's estimator (``eval_llada.py``): draw k uniform in 1..n, mask k positions drawn
uniformly, weight n/k. Its expectation is the bound's, with less variance than drawing t (no 1/t
weight near t = 0, no empty mask); it is the one used here. Each Monte Carlo sample draws every
block's k and positions independently; a row's estimate is the sum of its blocks' terms.

``estimates`` returns each row's estimate per sample, (B, samples); ``Bound`` summarises them: the
bound per scored token (mean over samples of sum over rows / tokens) and its Monte Carlo standard
error (the standard deviation of the per-sample means over sqrt(samples); NaN with one sample).

The draws are keyed hashes (``keyed_bits``: integer arithmetic) of (the row's key, the sample, the
block or position, ``seed``): the same rows give the same estimate on any device, batch
composition or rank count. The training loop keys its validation rows on their global sample
indices, so every evaluation scores the same masks.

Cost: one forward per block that holds scored tokens, over the clean prefix and the noised block
((j + 1) * block tokens: later blocks are invisible to block j, so they are left out), the samples
of a block as rows of one batch: about (n_blocks + 1) / 2 forwards of the whole window per sample.
Log-probabilities are normalised over the tokenizer's vocabulary (``cfg.vocab_size``), not the
padded rows of the embedding. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .diffusion import keyed_bits
from .dynamic import _M32, _mix32

_K_SALT = 0x27D4EB2F  # how many positions of a block are masked
_P_SALT = 0x165667B1  # which ones
_UNITS = 1 << 24  # keyed_bits' range


@dataclass
class Bound:
    """``nll``: the bound on the NLL per scored token (nats; mean over the samples); ``stderr``: its
    Monte Carlo standard error (NaN with one sample); ``tokens``: scored tokens; ``samples``."""

    nll: float
    stderr: float
    tokens: int
    samples: int


def _salt(seed: int, sample: int, base: int) -> int:
    """A 32-bit salt of (seed, Monte Carlo sample, stream)."""
    x = torch.tensor([(seed & _M32) ^ base, (sample * 0x9E3779B1 + base) & _M32], dtype=torch.int64)
    return int(_mix32((_mix32(x[:1]) + x[1:]) & _M32)[0])


def _draws(keys: torch.Tensor, samples: int, n: int, seed: int, base: int) -> torch.Tensor:
    """(B, samples, n) integers in [0, 2^24) keyed on (keys[b], sample, j, seed)."""
    return torch.stack([keyed_bits(keys, n, _salt(seed, s, base)) for s in range(samples)], 1)


@torch.no_grad()
def estimates(model, tokens: torch.Tensor, scored: torch.Tensor | None = None, *, samples: int, seed: int = 0,
              keys: torch.Tensor | None = None, max_rows: int = 64) -> torch.Tensor:
    """Each row's estimate of its NLL bound (nats, summed over its scored tokens) per Monte Carlo
    sample, (B, samples) float64. ``model``: an NCPModel whose objective is the CDLM's (``block``,
    ``mask_id``); ``tokens`` (B, L) clean ids, every row starting at position 0 (no padding);
    ``scored`` (B, L) bool: the positions whose likelihood is bounded (None: all); ``keys`` (B,)
    int: each row's noise key (None: the row index); ``max_rows``: rows per forward."""
    ob = model.objective
    b, mask_id, V = ob.block, ob.mask_id, model.cfg.vocab_size
    B, L = tokens.shape
    dev = tokens.device
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    scored = torch.ones_like(tokens, dtype=torch.bool) if scored is None else scored.to(dev, torch.bool)
    keys = (torch.arange(B) if keys is None else keys).to(dev, torch.int64)
    nb = -(-L // b)
    kbits = _draws(keys, samples, nb, seed, _K_SALT)  # (B, S, nb)
    pbits = _draws(keys, samples, L, seed, _P_SALT)  # (B, S, L)
    out = torch.zeros(B, samples, dtype=torch.float64, device=dev)
    for j in range(nb):
        lo, hi = j * b, min(L, (j + 1) * b)
        sc = scored[:, lo:hi]  # (B, w)
        n = sc.sum(1)  # (B,) scored positions of the block
        if not bool(n.any()):
            continue
        k = ((kbits[:, :, j] * n[:, None]) >> 24) + 1  # (B, S) uniform in 1..n
        r = pbits[:, :, lo:hi].masked_fill(~sc[:, None], _UNITS)  # (B, S, w): unscored positions last
        place = torch.sort(r, dim=-1, stable=True).indices.argsort(-1)  # each position's place in the random order
        masked = (place < k[..., None]) & sc[:, None]  # (B, S, w): k uniform positions of the scored ones
        nll = _masked_nll(model, tokens[:, :hi], masked, lo, mask_id, V, max_rows)  # (B, S)
        out += torch.where(n[:, None] > 0, nll * n[:, None] / k, torch.zeros_like(nll))
    return out


def _masked_nll(model, prefix: torch.Tensor, masked: torch.Tensor, lo: int, mask_id: int, V: int,
                max_rows: int) -> torch.Tensor:
    """sum over the masked positions of -log p(x_i | the clean prefix[:, :lo], the block with
    ``masked`` (B, S, w) replaced by [MASK]) per (row, sample), (B, S) float64."""
    B, S, w = masked.shape
    x = prefix[:, None].expand(B, S, prefix.shape[1]).clone()
    x[:, :, lo:] = x[:, :, lo:].masked_fill(masked, mask_id)
    x, m = x.reshape(B * S, -1), masked.reshape(B * S, w)
    target = prefix[:, None, lo:].expand(B, S, w).reshape(B * S, w)
    out = torch.zeros(B * S, dtype=torch.float64, device=prefix.device)
    for s in range(0, B * S, max_rows):
        rows = slice(s, s + max_rows)
        h = model(x[rows], return_hidden=True, compute_logits=False).hidden[:, lo:]  # (R, w, d)
        sel = m[rows]
        logp = model.head(h[sel])[:, :V].float().log_softmax(-1)  # (N, V): the masked positions only
        nll = -logp.gather(1, target[rows][sel][:, None])[:, 0].double()
        out[rows] = torch.zeros(sel.shape[0], dtype=torch.float64, device=out.device).index_add_(
            0, sel.nonzero()[:, 0], nll)
    return out.view(B, S)


def summarise(est: torch.Tensor, tokens: int) -> Bound:
    """A ``Bound`` from per-row, per-sample estimates (B, S) of ``tokens`` scored tokens."""
    per = est.sum(0).double().cpu() / max(tokens, 1)  # (S,) the bound per token of each sample
    S = per.numel()
    se = float(per.std()) / math.sqrt(S) if S > 1 else math.nan
    return Bound(float(per.mean()), se, int(tokens), S)


@torch.no_grad()
def one_shot_greedy(model, tokens: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """(B,) bool: whether every scored token is the argmax at its position when all the scored
    positions of its block are masked and the earlier blocks are clean (the sampler's first step on
    that block; not its confidence-ordered commits). lm-eval's ``is_greedy``."""
    ob = model.objective
    b, mask_id, V = ob.block, ob.mask_id, model.cfg.vocab_size
    ok = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for lo in range(0, tokens.shape[1], b):
        hi = min(tokens.shape[1], lo + b)
        sc = scored[:, lo:hi]
        if not bool(sc.any()):
            continue
        x = tokens[:, :hi].clone()
        x[:, lo:] = x[:, lo:].masked_fill(sc, mask_id)
        h = model(x, return_hidden=True, compute_logits=False).hidden[:, lo:]
        pred = model.head(h)[..., :V].argmax(-1)  # (B, w)
        ok &= ((pred == tokens[:, lo:hi]) | ~sc).all(1)
    return ok
