"""``ops`` section: how many operators a training step and a decode step launch (host overhead).

On a GPU every non-view aten operator is (at least) one kernel launch, and at small per-layer
work the launches, not the FLOPs, set the step time (the first H200 run: ~3,800 kernels per
pythia-160m step; IRC+CRC at 1.49x the plain step for 0.5% of its FLOPs). A CPU cannot time
that, but it can count it exactly: a ``TorchDispatchMode`` sees every aten operator that reaches
a backend, forward, backward (the autograd engine runs it under the same mode) and the optimizer,
after composite operators have decomposed into the ones that launch work. View operators
(``func.is_view``: reshape, transpose, slicing...), bare allocations (``empty*``) and ``detach``
launch nothing and are not counted; everything else, copies and ``.item()`` syncs included, is.

Per layer (the goal of issue "Fast where users train"): a design's count and its plain sibling's
are divided by their own number of layers (token and concept layers both counted), so a design
that adds concept layers is compared per unit of depth: ``per_layer_ratio`` = (design / its
layers) / (plain / its layers), and ``overhead_per_layer`` = (design - plain) / design's layers.

``compiled``: the same step under ``torch.compile`` (inductor) counted with ``torch.profiler``
events instead (compiled graphs run fused kernels the dispatch mode never sees): each inductor
kernel and each non-view aten call outside them is one launch. It compiles, so it is slow on a
CPU: a bench measure (``--only ops`` with ``--compile-ops``), not a test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from ncpctl.model.core.config import ConfigError, ModelConfig

# launch nothing: allocation without initialisation, autograd-only aliases
_FREE = ("_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
         "_record_function_enter_new", "_record_function_exit")


def count_ops(fn: Callable[[], Any]) -> Counter:
    """Run ``fn()`` once and count the aten operators it launches, by name (see module doc)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _FREE:
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    with _Count() as mode:
        fn()
    return mode.counts


def n_layers(cfg: ModelConfig) -> int:
    """Token layers plus concept layers: the depth a per-layer count divides by."""
    return cfg.n_token_layers + (cfg.concept.concept_layers if cfg.concept.enabled else 0)


def plain_sibling(cfg: ModelConfig) -> tuple[str, ModelConfig] | None:
    """What the recipe's design is compared with: for a depth mixer other than the default (IRC+CRC,
    Block AttnRes) or CRC connections, the same model with the default residual and no CRC (both keep
    the concept path); else, for a concept design, the base model without the concept path. None for
    a model that is its own plain sibling."""
    d = cfg.to_dict()
    default_residual = ModelConfig.__dataclass_fields__["residual"].default
    if d["residual"] != default_residual or d.get("crc_connections"):
        plain = {**d, "residual": default_residual, "crc_connections": []}
        label = f"{default_residual} residual, no CRC"
    elif cfg.concept.enabled:
        plain = {**d, "extra_token_layers": 0, "crc_connections": [], "concept": {**d["concept"], "enabled": False}}
        label = "base (no concept path)"
    else:
        return None
    try:
        return label, ModelConfig.from_dict(plain)
    except ConfigError:  # the design cannot be switched off alone
        return None


def training_step_ops(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 0) -> Counter:
    """Operators of one fwd + bwd + AdamW step on CPU fp32 (after one warm-up step, so that lazily
    created optimizer state does not count)."""
    import torch

    from ncpctl.profile.step import make_step

    _, step = make_step(cfg, batch, seq_len, torch.device("cpu"), torch.float32, seed=seed)
    step()
    return count_ops(step)


def decode_step_ops(cfg: ModelConfig, batch: int, prompt: int, seed: int = 0) -> Counter:
    """Operators of one cached decode step (batch rows, after a prompt of ``prompt`` tokens and one
    warm-up step), CPU fp32, eval mode."""
    import torch

    from ncpctl.model.core.model import NCPModel

    torch.manual_seed(seed)
    model = NCPModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (2, batch), generator=g)
    with torch.no_grad():
        _, st = model.prefill(tokens, [prompt] * batch, prompt + 4)
        model.decode_step(st, nxt[0])
        return count_ops(lambda: model.decode_step(st, nxt[1]))


def _summary(counts: Counter, layers: int, top: int = 12) -> dict[str, Any]:
    total = sum(counts.values())
    return {"total": total, "layers": layers, "per_layer": total / layers,
            "top": [{"op": k, "count": v} for k, v in counts.most_common(top)]}


def ops_section(cfg: ModelConfig, seq_len: int, batch: int, decode_batch: int = 1) -> dict[str, Any]:
    """Operator counts of the recipe's model and its plain sibling: per training step (eager) and per
    cached decode step, with the per-layer comparison (module doc)."""
    out: dict[str, Any] = {"kind": "aten operators launched (eager, CPU dispatch count; views and bare "
                                   "allocations excluded)", "batch_size": batch, "seq_len": seq_len}
    models = {"recipe": (cfg.name, cfg)}
    sib = plain_sibling(cfg)
    if sib is not None:
        models["sibling"] = sib
    for key, (label, c) in models.items():
        train = training_step_ops(c, batch, seq_len)
        entry = {"name": label, "train_step": _summary(train, n_layers(c))}
        if _causal(c):
            entry["decode_step"] = _summary(decode_step_ops(c, decode_batch, min(seq_len, 2 * _block(c))),
                                            n_layers(c))
        out[key] = entry
    if "sibling" in out:
        out["comparison"] = {k: per_layer(out["recipe"][k], out["sibling"][k])
                             for k in ("train_step", "decode_step") if k in out["recipe"] and k in out["sibling"]}
    return out


def per_layer(design: dict[str, Any], plain: dict[str, Any]) -> dict[str, float]:
    """A design's count against its plain sibling's, per layer of each (module doc)."""
    return {"ratio": design["total"] / plain["total"],
            "per_layer_ratio": design["per_layer"] / plain["per_layer"],
            "overhead_per_layer": (design["total"] - plain["total"]) / design["layers"]}


def _causal(cfg: ModelConfig) -> bool:
    """Whether the model decodes on KV caches (its objective is causal)."""
    from ncpctl.model.core.config import strategy

    return bool(strategy("objective", cfg.objective).causal)


def _block(cfg: ModelConfig) -> int:
    """Tokens per concept of a fixed segmentation (a prompt of two of them closes a concept), else 8."""
    return int(getattr(cfg.concept, "k", None) or 8)
