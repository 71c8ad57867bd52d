"""Decoupled muP (DLCM Sec. 6.1): which weights are *hidden*, and in which module's width.

With ``model.mup_base_width`` set, s_token = d_model / d_base and s_concept = d_concept / d_base_concept
(``ModelConfig.mup_widths``). The rule that sorts the weights: **a matrix whose fan-in scales with a
module's width is hidden in that module** (init variance, AdamW lr and AdamW epsilon / s of that
module); everything else keeps the base init and the base lr.

Hidden in the token module (s_token; fan-in d_model, or the FFN width / 2 d_model that scale with it):
  * every ``nn.Linear`` weight of the token blocks (``encoder``, ``decoder``: attention qkv / proj,
    MLP fc / proj, and a coupling's decoder sub-layers), of the MTP depths (``mtp``: proj 2d -> d and
    its layer);
  * the cross-attention coupling ``concept.coupling`` (W_Q, W_KV, W_O read token-width states: the
    memory ``pred`` has width d_model);
  * the boundary predictor ``concept.segmenter`` (W_q, W_k, d -> d; it keeps its identity init:
    ``owns_init``, so only its lr and epsilon follow);
  * the concept lift ``concept.up`` (W_up, d_model -> d_concept: its fan-in is the token width);
  * the concept bottleneck's Linears that read h (``bottleneck.known``, ``bottleneck.unknown`` or its
    first factor ``unknown.0``; owns_init: lr and epsilon only);
  * LoRA adapters inside those modules: A (fan-in d) is hidden, B (fan-in the rank r) is not.
Hidden in the concept module (s_concept; fan-in d_concept):
  * every ``nn.Linear`` weight of the concept blocks (``concept.layers``) and the concept heads
    ``concept.heads`` (d_concept -> S N: a readout over the codebook, whose fan-in is the concept width).
Base init and base lr: the embeddings (token, position), norms, every bias, the LM head (the logits
are divided by s_token instead, ``NCPModel.head``: the output multiplier of muP's readout), the
depth mixers (IRC / CRC / Block AttnRes: ``no_weight_decay`` modules), the codebook (its own init)
and the bottleneck's K, A B (fan-in n, r).

Shared by ``NCPModel.init_weights`` and the optimizer groups (``ncpctl.train.config``).
"""

from __future__ import annotations

from torch import nn

TOKEN_PREFIXES = ("encoder.", "decoder.", "mtp.", "concept.coupling.", "concept.segmenter.", "concept.up",
                  "bottleneck.known", "bottleneck.unknown", "bottleneck.unknown.0")  # unknown.1: fan-in r
CONCEPT_PREFIXES = ("concept.layers.", "concept.heads")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    """``name`` inside a prefix ending in ".", or equal to one without."""
    return any(name.startswith(p) if p.endswith(".") else name == p for p in prefixes)


def hidden_linears(model: nn.Module) -> dict[str, tuple[nn.Linear, str, float]]:
    """``{module name: (Linear, "token" | "concept", s)}`` of the hidden matrices of an ``NCPModel``
    (the module doc); empty without muP."""
    cfg = getattr(model, "cfg", None)  # any other module (a test's toy): no muP
    widths = cfg.mup_widths if cfg is not None else None
    if widths is None:
        return {}
    mixers = {id(m) for mixer in model.modules() if getattr(mixer, "no_weight_decay", False) for m in mixer.modules()}
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or id(m) in mixers or ".lora_B." in name:  # LoRA's B: fan-in r
            continue
        if _under(name, CONCEPT_PREFIXES):
            out[name] = (m, "concept", widths[1])
        elif _under(name, TOKEN_PREFIXES):
            out[name] = (m, "token", widths[0])
    return out
