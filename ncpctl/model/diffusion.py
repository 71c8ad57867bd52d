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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .bottleneck_positions import block_labels
from .config_diffusion import NAME
from .dynamic import _M32, _mix32
from .objective import Decoding, Objective
from .patterns import BlockCausal, Pattern

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
        from .diffusion_elbo import estimates

        x = window[:, :-1]
        est = estimates(model, x, samples=self.d.eval_samples, seed=0, keys=sample_ids)  # (B, S)
        return {"diffusion_elbo": torch.cat([est.sum(0), est.new_tensor([x.numel()])])}

    def validation_record(self, sums):
        if "diffusion_elbo" not in sums:
            return {}
        from .diffusion_elbo import summarise

        v = sums["diffusion_elbo"]
        b = summarise(v[None, :-1], int(v[-1]))
        return {"diffusion_elbo": b.nll, "diffusion_elbo_stderr": b.stderr}

    def loglikelihood_bounds(self, model, tokens, scored, *, samples, seed, greedy):
        from .diffusion_elbo import estimates, one_shot_greedy

        est = estimates(model, tokens, scored, samples=samples, seed=seed)
        return est, (one_shot_greedy(model, tokens, scored) if greedy else None)

    def noised_estimates(self, model, tokens, scored, *, samples, seed):
        """The noised-context estimates (B, samples) beside the bound (``ncpctl eval --noised-context``):
        every block noised, as training conditions each block (diffusion_elbo.noised_estimates)."""
        from .diffusion_elbo import noised_estimates

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
