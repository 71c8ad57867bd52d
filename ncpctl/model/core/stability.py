"""Attention stability diagnostics (NCP-ArchPreview Sec. 4.6, Figs. 5-6).

Per attention layer: the largest attention logit ``q . k * scale`` over the (query, key) pairs
the layer's mask lets attend, and the largest per-head L2 norm of a query and of a key. The
report shows them rising together with loss spikes under Muon with layer-wise QK-norm (Fig. 5)
and staying low with per-head QK-norm (Fig. 6).

SDPA never materialises the logits, so ``attention_stats`` runs one extra forward of a batch
(no grad) with a probe set on every ``Attention``. The probe receives exactly what SDPA receives
(q (B, H, T, hd) and k (B, Hkv, Tk, hd) after QK-norm and RoPE, and the mask) and computes the
logits in chunks of queries, so its memory is O(B * H * chunk * Tk), never T x T beyond what the
layer's own mask already holds. Without a probe (``Attention.probe is None``, the training
forward) an attention layer does nothing extra, so training is bit-identical with or without
these diagnostics.

The forward runs in eval mode (restored afterwards): dropout is off, so the numbers do not
depend on a random draw and the stats forward takes nothing from the RNG the training draws on.
The MTP head runs in training only, so with ``targets`` its layers are run explicitly. The extra
forward relies on an eval-mode forward updating no state (no running statistics, no EMA
codebook; true of every shipped design and toy), so that running it once more changes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ncpctl.model.core.layers import Attention

CHUNK_ELEMENTS = 1 << 25  # logits per chunk (B * H * chunk * Tk fp32: 128 MiB)
QUANTITIES = ("max_logit", "max_q_norm", "max_k_norm")
_STAGES = ("encoder", "concept", "decoder", "mtp")  # key order: the data flow


def attention_maxima(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, *,
                     scale: float | None = None, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """(3,) fp32: [max logit over visible pairs, max query norm, max key norm] of one SDPA call.

    q (B, H, Tq, hd), k (B, Hkv, Tk, hd) with H a multiple of Hkv (GQA: query head h reads key
    head h // (H / Hkv), as SDPA's ``enable_gqa``); ``mask`` a boolean SDPA mask (B|1, 1, Tq, Tk),
    True = attend, or None for SDPA's ``is_causal`` (query i sees keys 0..i). ``scale``: SDPA's,
    default 1/sqrt(hd). Norms are the L2 norms of each head's vector at each position."""
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv  # query heads per key head
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attention_maxima: a boolean mask is expected, got {mask.dtype}")
    scale = hd ** -0.5 if scale is None else scale
    q, k = q.float(), k.float()
    q_norm = torch.linalg.vector_norm(q, dim=-1).amax()
    k_norm = torch.linalg.vector_norm(k, dim=-1).amax()
    qg = (q * scale).unflatten(1, (Hkv, G))  # (B, Hkv, G, Tq, hd)
    chunk = max(1, chunk_elements // max(1, B * H * Tk))
    best = q.new_full((), -math.inf)
    for s in range(0, Tq, chunk):
        e = min(Tq, s + chunk)
        lo, hi, visible = _visible(mask, s, e, Tk, q.device)  # keys lo:hi, visible (B|1, 1, 1, c, hi-lo)
        if hi == lo:
            continue
        logits = qg[:, :, :, s:e].reshape(B, Hkv, G * (e - s), hd) @ k[:, :, lo:hi].transpose(-1, -2)
        logits = logits.view(B, Hkv, G, e - s, hi - lo).masked_fill_(~visible, -math.inf)  # (B, Hkv, G, c, keys)
        best = torch.maximum(best, logits.amax())
    return torch.stack([best, q_norm, k_norm])


def _visible(mask: torch.Tensor | None, s: int, e: int, Tk: int, device) -> tuple[int, int, torch.Tensor]:
    """Queries s:e: the key range lo:hi holding every visible key, and which are visible there."""
    if mask is None:  # is_causal (top-left aligned, as SDPA): query i sees keys 0..i
        hi = min(e, Tk)
        rows, cols = torch.arange(s, e, device=device), torch.arange(hi, device=device)
        return 0, hi, (rows[:, None] >= cols[None])[None, None, None]
    m = mask[..., s:e, :]  # (B|1, 1, c, Tk)
    cols = m.reshape(-1, Tk).any(0).nonzero()  # a sliding window sees only part of the keys
    lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 0)
    return lo, hi, m[..., lo:hi].unsqueeze(2)


class _Probe:
    """Set as ``Attention.probe`` while ``attention_stats`` runs: keeps the maxima of its calls."""

    def __init__(self, chunk_elements: int):
        self.chunk_elements = chunk_elements
        self.value: torch.Tensor | None = None  # (3,) as attention_maxima

    def __call__(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        v = attention_maxima(q, k, mask, chunk_elements=self.chunk_elements)
        self.value = v if self.value is None else torch.maximum(self.value, v)


def _layers(model: nn.Module) -> dict[str, Attention]:
    """Every attention layer by the path of its block (``encoder.0``, ``concept.layers.1``,
    ``decoder.3``, ``mtp.depths.0.layer.0``: the state-dict prefixes), in data-flow order."""
    found = [(name.removesuffix(".attn"), m) for name, m in model.named_modules() if isinstance(m, Attention)]
    stage = {s: i for i, s in enumerate(_STAGES)}
    return dict(sorted(found, key=lambda x: stage.get(x[0].split(".")[0], len(_STAGES))))  # stable sort


@torch.no_grad()
def attention_stats(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                    chunk_elements: int = CHUNK_ELEMENTS, doc_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One forward of ``model`` (an ``NCPModel``) on token ids idx (B, T) -> 0-dim fp32 tensors:
    ``attn/max_logit``, ``attn/max_q_norm``, ``attn/max_k_norm`` (over all layers), then
    ``attn/{layer}/{quantity}`` per layer (``_layers``' names). Tensors on idx's device, not
    floats: a caller reduces them over ranks in one collective. With ``targets`` (B, T) the MTP
    depths run too; layers that did not run (no concept closed) are left out. ``doc_ids`` (B, T):
    packed documents (the forward's), so the maxima are over the pairs the training forward sees."""
    layers = _layers(model)
    probes = {name: _Probe(chunk_elements) for name in layers}
    modes = {m: m.training for m in model.modules()}
    mtp = getattr(model, "mtp", None) if targets is not None else None
    try:
        model.eval()
        for name, attn in layers.items():
            attn.probe = probes[name]
        out = model(idx, return_hidden=mtp is not None, compute_logits=False, doc_ids=doc_ids)
        if mtp is not None:
            mtp(out.hidden, targets, model, doc_ids)
    finally:
        for attn in layers.values():
            attn.__dict__.pop("probe", None)  # back to the class default, None
        for m, training in modes.items():
            m.training = training
    ran = {name: p.value for name, p in probes.items() if p.value is not None}
    if not ran:
        return {}
    overall = torch.stack(list(ran.values())).amax(0)
    stats = {f"attn/{q}": overall[i] for i, q in enumerate(QUANTITIES)}
    for name, v in ran.items():
        stats.update({f"attn/{name}/{q}": v[i] for i, q in enumerate(QUANTITIES)})
    return stats
