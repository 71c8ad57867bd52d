"""Steerling's Causal Diffusion LM objective (``model.objective: causal_diffusion``; keys
``model.diffusion.*``, config_diffusion.py; shared/papers/004: MDLM, Block Diffusion, Causal
Diffusion, Fig. 15).

* Attention is block-causal: ``BlockCausal(block_size, window)`` (patterns.py), bidirectional
  inside a block, causal across blocks (``q // block >= k // block``); a boolean mask on every
  device for now.
* Training reads ONE noisy copy of the sequence (Block Diffusion reads a noisy and a clean copy):
  of a data window (B, T+1) the inputs are its first T tokens (the last one, which next-token
  prediction needs as the last target, is not used: no shift anywhere on this path); each block b
  of a row draws its mask rate t_b (``schedule``), each token of the block becomes [MASK]
  (``mask_id``) with probability t_b, and the targets are the original tokens at the masked
  positions (-100 elsewhere): each masked token is predicted at its own position.
* The noise is a hash of (the row's global sample index, the block or position), integer arithmetic
  only (``keyed_uniform``, as DLCM's boundary noise): one rank or two, a resumed run and any batch
  composition draw the same masks for a sample. The loop hands the sample indices through
  ``keyed_batch`` (training and validation alike); ``batch`` alone keys on the row index.
* The loss (``weighting``): masked_mean = the mean cross-entropy over the masked tokens of the
  micro-batch (the fused head, as next-token prediction; a block weighs in proportion to its rate
  t_b, the number of its masked tokens); inverse_t = each masked token's cross-entropy over its
  block's t_b, summed and divided by the number of tokens (MDLM's 1/t weighting; formerly named
  elbo). Neither bounds the NLL of the model as sampled: with ONE noisy copy, each block is
  conditioned on noised earlier blocks, while the sampler and the held-out bound (diffusion_elbo.py)
  condition on clean ones; and under ``schedule: gaussian`` 1/t without the curriculum's 1/q(t)
  importance weight is no bound at all (config_diffusion.py refuses inverse_t there). The inverse_t
  weighting needs t_b in the loss: its targets carry it (``target = token + padded_vocab * q_b``, q_b the
  block's rate in 1/2^24 units, the same quantised rate that drew the masks), which ``loss`` decodes;
  its logits are computed unfused (the fused head computes a plain mean). A micro-batch with no
  masked token has loss 0 under either weighting.

Generation is block-wise (``block_sampling``: ``generate`` runs ncpctl/inference/causal_diffusion.py,
block by block on KV caches), not token by token (``decoding`` refuses).

Likelihood (diffusion_elbo.py): the held-out ELBO, each block scored on the clean earlier blocks,
Monte Carlo over the masks with a reported standard error; it is the validation's ``diffusion_elbo``
(``validation``; ``diffusion.eval_samples``) whatever weighting trains the model, and answers lm-eval
(``bound``: ``loglikelihood_bounds``; a continuation noised, its context clean, LLaDA-style).

The export carries the model's own forward (remote code, ncpctl/interop/remote/modeling_ncp.py),
which refuses transformers' token-by-token ``generate``.

The held-out ELBO (below ``CausalDiffusion``; it was diffusion_elbo.py):

The held-out ELBO of a Causal Diffusion LM (diffusion.py; issue 23 item 4): a Monte Carlo
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

Cost (``method``): ``two_copy`` (the default) runs ONE forward per sample, BD3-LM's two-copy
layout: the noised copies of the blocks that hold scored tokens, then the clean prefix up to the
last of them, in one sequence (at most 2L - block tokens); each noised block attends to itself and
to the clean blocks before it, each clean block to the clean blocks up to it, so every noised
block's states are exactly those of a forward over [its clean prefix, itself]. ``per_block`` (the
reference it is tested against) runs one forward per block that holds scored tokens, over the clean
prefix and the noised block ((j + 1) * block tokens): about (n_blocks + 1) / 2 forwards of the
window per sample. The two agree to float rounding (1e-6 nats on a debug model: tests/model/
test_diffusion_elbo.py); the speed-up is measured by bench/cdlm_bound.py (docs/designs/steerling.md). The samples are
rows of one batch either way (``max_rows`` per forward). Log-probabilities are normalised over the tokenizer's vocabulary (``cfg.vocab_size``), not the
padded rows of the embedding. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ncpctl.model.designs.bottleneck.chunks import block_labels
from ncpctl.model.designs.causal_diffusion.config import NAME
from ncpctl.model.designs.dynamic.module import _M32, _mix32
from ncpctl.model.core.objective import Decoding, Objective
from ncpctl.model.core.patterns import BlockCausal, Pattern, as_pattern
from ncpctl.model.core.slots import slot_states

_TOKEN_SALT = 0x85EBCA6B  # the per-token draws (mask or not)
_BLOCK_SALT = 0xC2B2AE35  # the per-block draws (the mask rate)
_UNITS = 1 << 24  # resolution of every draw and of the rates the inverse_t targets carry


def keyed_bits(sample_ids: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """Integers in [0, 2^24) (B, n) int64 that depend only on (sample_ids[b], j, salt): the same
    draws for a sample on any rank, batch position or device (DLCM's hash, its own salts)."""
    sid = sample_ids.to(torch.int64)
    key = _mix32(_mix32((sid & _M32) ^ salt) ^ ((sid >> 32) & _M32))  # (B,)
    j = _mix32(torch.arange(n, device=sid.device, dtype=torch.int64) + salt)  # (n,)
    return _mix32((key[:, None] + j[None]) & _M32) >> 8


class CausalDiffusion(Objective):
    loss_key = "diffusion_loss"
    causal = False  # a position sees the rest of its block
    block_sampling = True  # generate: block by block, most confident [MASK]s first (inference/causal_diffusion.py)
    bound = True  # log-likelihoods are ELBO estimates (diffusion_elbo.py)

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.diffusion
        if d.mask_id is None:
            raise ValueError(f"model.diffusion.mask_id is not set: objective {NAME} needs the [MASK] token's id "
                             f"(the recipe loader reads it from the tokenizer's {d.mask_token!r})")
        self.block, self.mask_id, self.d = d.block_size, d.mask_id, d
        self.vocab = cfg.padded_vocab_size
        self.step = 0  # the optimizer step (the gaussian schedule's mean follows it)

    def pattern(self, window: int | None) -> Pattern:
        return BlockCausal(self.block, window)

    def on_step_begin(self, step: int) -> None:
        self.step = step

    # ---- noise ----

    def rate_units(self, sample_ids: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Each block's mask rate t_b in 1/2^24 units (B, n_blocks) int64, in [min_t, 1]."""
        d = self.d
        u = (keyed_bits(sample_ids, n_blocks, _BLOCK_SALT).double() + 0.5) / _UNITS  # (0, 1)
        if d.schedule == "gaussian":
            frac = min(self.step / d.gaussian_steps, 1.0) if d.gaussian_steps > 0 else 1.0
            mu = d.gaussian_mean_start + (d.gaussian_mean_end - d.gaussian_mean_start) * frac
            t = mu + d.gaussian_std * torch.special.ndtri(u)
        else:
            t = d.min_t + (1 - d.min_t) * u
        lo = int(-(-d.min_t * _UNITS // 1))  # ceil: the quantised rate stays >= min_t
        return (t.clamp(0, 1) * _UNITS).round().to(torch.int64).clamp(lo, _UNITS)

    def noise(self, window: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked (B, T) bool, the rate of each position's block (B, T) in 1/2^24 units) of the
        inputs of ``window`` (B, T+1) whose rows are the samples ``sample_ids`` (B,)."""
        B, T = window.shape[0], window.shape[1] - 1
        nb = -(-T // self.block)
        ids = sample_ids.to(window.device)
        rate = self.rate_units(ids, nb).repeat_interleave(self.block, dim=1)[:, :T]  # (B, T)
        return keyed_bits(ids, T, _TOKEN_SALT) < rate, rate

    # ---- the objective ----

    def keyed_batch(self, window: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = window[:, :-1]  # (B, T): the window's first T tokens; no shift
        masked, rate = self.noise(window, sample_ids)
        y = torch.where(masked, x, torch.full_like(x, -100))
        if self.d.weighting == "inverse_t":
            y = torch.where(masked, y + self.vocab * rate, y)  # carry t_b to the loss
        return x.masked_fill(masked, self.mask_id), y

    def batch(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keyed on the row index (the loop passes the global sample indices: ``keyed_batch``)."""
        return self.keyed_batch(window, torch.arange(window.shape[0], device=window.device))

    def loss(self, model, h: torch.Tensor, targets: torch.Tensor):
        if self.d.weighting != "inverse_t":  # the mean cross-entropy over the masked tokens
            logits, loss = model.head(h, targets)
            # none masked (a short, lightly noised micro-batch): 0, not the empty mean's NaN (no host sync)
            return logits, torch.where((targets != -100).any(), loss, torch.zeros_like(loss))
        hit = targets >= 0
        tok = torch.where(hit, targets % self.vocab, targets)
        t = torch.where(hit, targets // self.vocab, _UNITS).to(torch.float32) / _UNITS  # (B, T)
        logits = model.head(h)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), tok.flatten(), reduction="none")  # 0 where ignored
        return (logits if not torch.is_grad_enabled() else None), (ce / t.flatten()).sum() / targets.numel()

    # ---- the ELBO (diffusion_elbo.py): validation and lm-eval ----

    def validation(self, model, window, sample_ids):
        """Each sample's summed ELBO estimates over the micro-batch's inputs (the window's first T
        tokens), then the token count: (eval_samples + 1,) float64."""
        if self.d.eval_samples < 1:
            return {}

        x = window[:, :-1]
        est = estimates(model, x, samples=self.d.eval_samples, seed=0, keys=sample_ids)  # (B, S)
        return {"diffusion_elbo": torch.cat([est.sum(0), est.new_tensor([x.numel()])])}

    def validation_record(self, sums):
        if "diffusion_elbo" not in sums:
            return {}

        v = sums["diffusion_elbo"]
        b = summarise(v[None, :-1], int(v[-1]))
        return {"diffusion_elbo": b.nll, "diffusion_elbo_stderr": b.stderr}

    def loglikelihood_bounds(self, model, tokens, scored, *, samples, seed, greedy):

        est = estimates(model, tokens, scored, samples=samples, seed=seed)
        return est, (one_shot_greedy(model, tokens, scored) if greedy else None)

    def noised_estimates(self, model, tokens, scored, *, samples, seed):
        """The noised-context estimates (B, samples) beside the bound (``ncpctl eval --noised-context``):
        every block noised, as training conditions each block (diffusion_elbo.noised_estimates)."""

        return noised_estimates(model, tokens, scored, samples=samples, seed=seed)

    # ---- the concept bottleneck on a CDLM (bottleneck.py's docstring) ----

    def concept_positions(self, idx, targets):
        return idx == self.mask_id  # (B, T): the concept loss reads the masked tokens (Steerling)

    def fed_labels(self, labels, chunk):
        return block_labels(labels, self.block)  # the own block's label: the block is generated jointly

    def target_tokens(self, targets):
        return torch.where(targets >= 0, targets % self.vocab, targets)  # inverse_t targets carry t_b

    def score(self, context, continuation, max_len):
        raise ValueError(f"objective {NAME}: log-likelihoods are ELBO estimates (loglikelihood_bounds), "
                         "not read from one forward")

    def decoding(self, model, tokens, lengths, max_len, interventions=None) -> Decoding:
        raise ValueError(f"objective {NAME} does not decode token by token: generate samples it block by block "
                         "(ncpctl.inference.generate, block_sampling)")


_K_SALT = 0x27D4EB2F  # how many positions of a block are masked
_P_SALT = 0x165667B1  # which ones


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
              keys: torch.Tensor | None = None, max_rows: int = 64, method: str = "two_copy") -> torch.Tensor:
    """Each row's estimate of its NLL bound (nats, summed over its scored tokens) per Monte Carlo
    sample, (B, samples) float64. ``model``: an NCPModel whose objective is the CDLM's (``block``,
    ``mask_id``); ``tokens`` (B, L) clean ids, every row starting at position 0 (no padding);
    ``scored`` (B, L) bool: the positions whose likelihood is bounded (None: all); ``keys`` (B,)
    int: each row's noise key (None: the row index); ``max_rows``: rows per forward; ``method``:
    two_copy or per_block (the module docstring: the same masks, the same estimate)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if method not in ("two_copy", "per_block"):
        raise ValueError(f"method must be two_copy or per_block, got {method!r}")
    B, L = tokens.shape
    scored = torch.ones_like(tokens, dtype=torch.bool) if scored is None else scored.to(tokens.device, torch.bool)
    keys = (torch.arange(B) if keys is None else keys).to(tokens.device, torch.int64)
    masked, weight, blocks = draw_masks(model.objective.block, scored, samples, seed, keys)
    if method == "two_copy":
        nll = two_copy_nll(model, tokens, masked, blocks, max_rows)  # (B, S, L)
        return (nll * weight).sum(-1)
    b, out = model.objective.block, torch.zeros(B, samples, dtype=torch.float64, device=tokens.device)
    for j in blocks:
        lo, hi = j * b, min(L, (j + 1) * b)
        nll = _masked_nll(model, tokens[:, :hi], masked[:, :, lo:hi], lo, max_rows)  # (B, S)
        out += nll * weight[:, :, lo]
    return out


def draw_masks(b: int, scored: torch.Tensor, samples: int, seed: int,
               keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The keyed masks of every sample: (masked (B, S, L) bool, each position's block weight n/k
    (B, S, L) float64 (0 in a row's blocks without scored tokens), the blocks that hold a scored
    token in some row). Block j of row b masks k uniform in 1..n of its n scored positions."""
    B, L = scored.shape
    nb = -(-L // b)
    kbits = _draws(keys, samples, nb, seed, _K_SALT)  # (B, S, nb)
    pbits = _draws(keys, samples, L, seed, _P_SALT)  # (B, S, L)
    masked = torch.zeros(B, samples, L, dtype=torch.bool, device=scored.device)
    weight = torch.zeros(B, samples, L, dtype=torch.float64, device=scored.device)
    blocks = []
    for j in range(nb):
        lo, hi = j * b, min(L, (j + 1) * b)
        sc = scored[:, lo:hi]  # (B, w)
        n = sc.sum(1)  # (B,) scored positions of the block
        if not bool(n.any()):
            continue
        blocks.append(j)
        k = ((kbits[:, :, j] * n[:, None]) >> 24) + 1  # (B, S) uniform in 1..n
        r = pbits[:, :, lo:hi].masked_fill(~sc[:, None], _UNITS)  # (B, S, w): unscored positions last
        place = torch.sort(r, dim=-1, stable=True).indices.argsort(-1)  # each position's place in the random order
        masked[:, :, lo:hi] = (place < k[..., None]) & sc[:, None]  # k uniform positions of the scored ones
        w = torch.where(n[:, None] > 0, n[:, None] / k, torch.zeros_like(k, dtype=torch.float64))  # (B, S)
        weight[:, :, lo:hi] = w[..., None]
    return masked, weight, blocks


def two_copy_masks(model, positions: torch.Tensor, noisy: torch.Tensor) -> dict:
    """Attention masks (1, 1, n, n) of a two-copy sequence, one per pattern key: slot i at position
    ``positions[i]`` (n,), of the noisy copy where ``noisy[i]``. A noisy query sees its own noised
    block and the clean blocks before it; a clean query the clean slots its pattern lets it see
    (block-causal: its block and earlier ones); the pattern's window holds on positions throughout."""
    blk = positions // model.objective.block
    same = blk[:, None] == blk[None, :]
    earlier = blk[None, :] < blk[:, None]
    nq, nk = noisy[:, None], noisy[None, :]
    copies = (nq & nk & same) | (nq & ~nk & earlier) | (~nq & ~nk)  # (n, n)
    return {p.key: p.mask(positions[None], positions[None]) & copies for p in map(as_pattern, model.token_patterns)}


def two_copy_nll(model, tokens: torch.Tensor, masked: torch.Tensor, blocks: list[int], max_rows: int) -> torch.Tensor:
    """-log p(x_i | the clean earlier blocks, x_i's block with ``masked`` replaced by [MASK]) at every
    masked position, 0 elsewhere, (B, S, L) float64, from one two-copy forward per (row, sample)."""
    ob, V = model.objective, model.cfg.vocab_size
    B, S, L = masked.shape
    dev = tokens.device
    out = torch.zeros(B, S, L, dtype=torch.float64, device=dev)
    if not blocks:
        return out
    noisy_at = torch.cat([torch.arange(j * ob.block, min(L, (j + 1) * ob.block), device=dev) for j in blocks])
    c = blocks[-1] * ob.block  # the clean prefix that a noised block can see
    pos = torch.cat([noisy_at, torch.arange(c, device=dev)])  # (n,)
    masks = two_copy_masks(model, pos, torch.arange(len(pos), device=dev) < len(noisy_at))
    m = masked[:, :, noisy_at]  # (B, S, n1)
    x = torch.cat([tokens[:, None, noisy_at].expand(B, S, -1).masked_fill(m, ob.mask_id),
                   tokens[:, None, :c].expand(B, S, c)], -1).reshape(B * S, -1)  # (B*S, n)
    m, target = m.reshape(B * S, -1), tokens[:, None, noisy_at].expand(B, S, -1).reshape(B * S, -1)
    nll = torch.zeros(B * S, len(noisy_at), dtype=torch.float64, device=dev)
    for s in range(0, B * S, max_rows):
        rows = slice(s, s + max_rows)
        h = slot_states(model, x[rows], pos[None], masks)[:, : len(noisy_at)]  # (R, n1, d)
        sel = m[rows]
        logp = model.head(h[sel])[:, :V].float().log_softmax(-1)  # (N, V): the masked positions only
        nll[rows][sel] = -logp.gather(1, target[rows][sel][:, None])[:, 0].double()
    out[:, :, noisy_at] = nll.view(B, S, -1)
    return out


def _masked_nll(model, prefix: torch.Tensor, masked: torch.Tensor, lo: int, max_rows: int) -> torch.Tensor:
    """sum over the masked positions of -log p(x_i | the clean prefix[:, :lo], the block with
    ``masked`` (B, S, w) replaced by [MASK]) per (row, sample), (B, S) float64: one forward of the
    prefix and the block (``per_block``)."""
    mask_id, V = model.objective.mask_id, model.cfg.vocab_size
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


@torch.no_grad()
def noised_estimates(model, tokens: torch.Tensor, scored: torch.Tensor | None = None, *, samples: int,
                     seed: int = 0, keys: torch.Tensor | None = None, max_rows: int = 64) -> torch.Tensor:
    """The noised-context estimate (B, samples) float64: the conditions training reads (one noisy
    copy, diffusion.py). Every block of a row is noised at once, each as ``estimates`` noises a
    scored block (k uniform in 1..n of its n positions masked: Bernoulli(t) masks with t ~ U(0, 1)
    integrated out, the empty mask left out), in ONE forward per sample, and the masked scored
    tokens' -log p are weighted n/k. A block is conditioned on NOISED earlier blocks, so this is not a
    bound on the model as sampled (``estimates`` is: clean earlier blocks); it is what the model is
    trained on. The masks are ``estimates``'s own (the same keys and seed) wherever every position is
    scored, so the two differ only in the earlier blocks' noise: a paired comparison (validation's
    windows, perplexity sets). On the first block the two are equal."""
    ob, V = model.objective, model.cfg.vocab_size
    B, L = tokens.shape
    scored = torch.ones_like(tokens, dtype=torch.bool) if scored is None else scored.to(tokens.device, torch.bool)
    keys = (torch.arange(B) if keys is None else keys).to(tokens.device, torch.int64)
    masked, weight, _ = draw_masks(ob.block, torch.ones_like(scored), samples, seed, keys)  # (B, S, L) each
    x = tokens[:, None].expand(B, samples, L).masked_fill(masked, ob.mask_id).reshape(B * samples, L)
    m = (masked & scored[:, None]).reshape(B * samples, L)
    w = weight.reshape(B * samples, L)
    target = tokens[:, None].expand(B, samples, L).reshape(B * samples, L)
    out = torch.zeros(B * samples, dtype=torch.float64, device=tokens.device)
    for s in range(0, B * samples, max_rows):
        rows = slice(s, s + max_rows)
        h = model(x[rows], return_hidden=True, compute_logits=False).hidden  # (R, L, d)
        sel = m[rows]
        logp = model.head(h[sel])[:, :V].float().log_softmax(-1)  # (N, V): the masked scored positions
        nll = -logp.gather(1, target[rows][sel][:, None])[:, 0].double() * w[rows][sel]
        out[rows] = torch.zeros(sel.shape[0], dtype=torch.float64, device=out.device).index_add_(
            0, sel.nonzero()[:, 0], nll)
    return out.view(B, samples)


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
