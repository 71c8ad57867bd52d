"""A decode step of fixed shapes and no host sync (issue 45 item 5): what a CUDA graph can replay.

``decode.step`` is exact and cheap on a CPU, but each step's shapes follow the host: keys are read
up to the slot (a (B, H, s+1, hd) view that grows every step), the concept step runs only for the
rows the host knows closed a block, and its cache is read up to the largest concept index. On a GPU
that is ~250 kernel launches a step from Python (0.8 ms of kernels in 6-11 ms of wall time at
pythia-160m, docs/gpu/README.md). ``static_step`` computes the same logits with shapes fixed by the
decode state's capacity, so one step can be captured once and replayed:

* the write index is a device tensor ``slot`` (0-dim long) that the step advances in place; each
  row's position is ``slot - pad``;
* every token layer writes its new key/value at ``slot`` and attends over the whole capacity
  (B, H, capacity, hd) under a mask: keys at later slots have later positions, so the causal
  pattern hides them, and padding keys are invalid, exactly as in ``decode.step``;
* the concept path is the every-row variant of ``decode._concept_step`` (the segmenter is asked
  with ``pos_host=None``: FixedBlocks and DLCM's boundaries answer from the device alone): every
  row runs the concept layers over the whole concept cache, rows that closed nothing write a
  throw-away entry at their next concept index (overwritten when it closes) and keep their state;
* the per-row state a step replaces (segmenter, coupling, CRC) is copied back into the tensors
  the state held before the step, so every buffer keeps its address from step to step.

``static_refusal`` says why a model or a state cannot take this step (then ``decode.step`` runs):
caches without a capacity (``prefill(max_len=None)``), ragged rows (speculative decoding),
interventions, or a segmenter / coupling that does not declare ``static_decode``. The CUDA graph
itself is captured outside the model (ncpctl/inference/cuda_graphs.py).
"""

from __future__ import annotations

import torch

from ncpctl.model.core.decode import DecodeState, _concept_step, _contexts, _decoder_context, _encode
from ncpctl.model.core.layers import Context, rope
from ncpctl.model.core.patterns import step_masks


def static_refusal(model, st: DecodeState) -> str | None:
    """Why ``static_step`` cannot run for ``st`` (None: it can)."""
    if st.capacity is None:
        return "the KV caches grow (prefill without max_len)"
    if st.behind is not None:
        return "rows are at different slots (speculative decoding)"
    if st.interventions:
        return "interventions are applied"
    cm = model.concept
    if cm is not None:
        for part in (cm.segmenter, cm.coupling):
            if not getattr(part, "static_decode", False):
                return f"{type(part).__name__} does not declare static_decode (it may read the host every step)"
    return None


def _keep_addresses(before: dict[str, dict], st: DecodeState) -> bool:
    """Copy the tensors a step put in ``st``'s per-row dicts back into the ones they replaced
    (``before``: name -> the dict's entries before the step); True when every one could be (a new
    key or a changed shape or dtype, e.g. a coupling's store growing, keeps the new tensor)."""
    kept = True
    for name, old in before.items():
        new = getattr(st, name)
        for k, t in new.items():
            o = old.get(k)
            if t is o:
                continue
            if o is not None and o.shape == t.shape and o.dtype == t.dtype:
                o.copy_(t)
                new[k] = o
            else:
                kept = False
    return kept


@torch.no_grad()
def static_step(model, st: DecodeState, tokens: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Feed one token per row, tokens (B,), at the device-held slot ``slot`` (0-dim long, advanced
    by one in place) -> (next-token logits (B, V), whether every state tensor kept its address).
    Leaves ``st.slot`` (the host's copy) to the caller; ``static_refusal(model, st)`` must be None."""
    cfg, B, cap = model.cfg, tokens.shape[0], st.capacity
    dev = tokens.device
    before = {name: dict(getattr(st, name)) for name in ("seg", "cpl", "crc")}
    pos = slot - st.pad_t  # (B,) each row's position
    x = model.embed_tokens(tokens[:, None], pos[:, None].clamp_max(cfg.max_seq_len - 1))  # (B, 1, d)
    cos, sin = rope(pos[:, None], cfg, x.dtype, limit=cap)
    keys = torch.arange(cap, device=dev)
    valid = keys[None] >= st.pad_t[:, None]  # (B, cap) real tokens (later slots: later positions, masked)
    masks = step_masks(model.token_patterns, pos[:, None], keys[None] - st.pad_t[:, None], valid)
    at = slot.expand(B)  # (B,) the write index, from the device
    enc, dec = _contexts(model, [], Context(cos, sin, masks, at=at, length=cap), pos[:, None], x, st)
    h, depths = _encode(model, x, enc)
    z, concept_depths = h, None
    if model.concept is not None:
        z, concept_depths = _concept_step(model, st, h, pos, None, [], depths)
    dec = _decoder_context(model, dec, st, pos[:, None], depths, concept_depths)
    st.hidden = model.decode(z, dec)  # (B, 1, d)
    slot.add_(1)
    kept = _keep_addresses(before, st)
    return model.head(model.readout(st.hidden)[0])[:, 0], kept


class StaticDecoder:
    """Steps of ``static_step`` on one decode state, the host's ``st.slot`` kept in step; the same
    calls a CUDA graph replays (cuda_graphs.py), run eagerly (the CPU, or a fallback)."""

    def __init__(self, model, st: DecodeState):
        why = static_refusal(model, st)
        if why is not None:
            raise ValueError(f"no static decode step: {why}")
        self.model, self.state = model, st
        self.slot = torch.tensor(st.slot, device=st.pad_t.device)  # the device's write index

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (B,) -> next-token logits (B, V), as ``decode.step``."""
        st = self.state
        if st.slot >= st.capacity:
            raise ValueError(f"decode state is full ({st.capacity} slots); prefill with a larger max_len")
        logits, _ = static_step(self.model, st, tokens, self.slot)
        st.slot += 1
        return logits
