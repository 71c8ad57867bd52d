"""The token stacks run over an arbitrary layout of slots: what the Causal Diffusion LM's block
sampler (block_sampler.py: the finished blocks and the current one on KV caches) and its two-copy
likelihood bound (diffusion_elbo.py: a noisy and a clean copy in one sequence) share.

``NCPModel.forward`` builds its context from T consecutive positions and the declared patterns;
here the caller gives each slot's position and the attention masks (``Context.masks``: one per
pattern key), so two slots may hold the same position (two copies) and a slot may sit behind cached
ones. A model without the concept path only (the CDLM refuses it: config_diffusion.py), so the
stages are embed -> encoder -> decoder -> final norm, with the interventions a full forward honours
(interventions.py: residual additions, the decoder input; the readout's is the caller's, after
``model.readout``). No I/O."""

from __future__ import annotations

from typing import Sequence

import torch

from ncpctl.model.core.interventions import Intervention, decoder_input_addition, residual_additions
from ncpctl.model.core.layers import Context, rope


def slot_states(model, idx: torch.Tensor, positions: torch.Tensor, masks: dict, *, caches: tuple | None = None,
                at: int = 0, length: int = 0, ivs: Sequence[Intervention] = (),
                iv_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm states (B, n, d) of token ids idx (B, n) at RoPE positions ``positions`` (B|1, n)
    (>= 0) under ``masks``. ``caches``: (encoder, decoder) KV caches written at slot ``at`` and read
    up to ``length`` (None: no cache). ``ivs`` apply at ``iv_positions`` (B|1, n) (default:
    ``positions``; a padding slot's negative position is never intervened)."""
    if model.concept is not None:
        raise ValueError("slot_states runs models without the concept path (a Causal Diffusion LM)")
    cos, sin = rope(positions, model.cfg, model.embed.weight.dtype)
    ctx = Context(cos, sin, masks, at=at, length=length)
    where = positions if iv_positions is None else iv_positions
    h = model.embed_tokens(idx, positions)  # (B, n, d)
    enc, dec = ctx, ctx
    if ivs:
        enc = ctx.with_(adds=residual_additions(ivs, "encoder", len(model.encoder), where, h))
        dec = ctx.with_(adds=residual_additions(ivs, "decoder", len(model.decoder), where, h))
    if caches is not None:
        enc, dec = enc.with_(caches=caches[0]), dec.with_(caches=caches[1])
    if model._keeps_encoder_depths(False):
        h, depths = model.encode(h, enc, states=True)
    else:
        h, depths = model.encode(h, enc), None
    z = decoder_input_addition(ivs, h, where) if ivs else h
    return model.decode(z, model.decoder_crc(dec, depths, None))
