"""The static-shape decode step (ncpctl/model/core/decode_static.py, issue 45 item 5): what a CUDA graph
replays on a GPU, run eagerly here. Every shipped design that decodes gives the full forward's
logits at every new token of a ragged batch (float64, as tests/model/test_designs.py), keeps every
state buffer at its address from step to step (a captured graph writes where it was captured), and
only toy strategies that do not declare ``static_decode`` fall back to ``decode.step``."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.core.decode import step
from ncpctl.model.core.decode_static import StaticDecoder, static_refusal, static_step

from ._helpers import build, ragged_batch, tiny
from .test_bottleneck import bn_cfg
from .test_designs import DESIGNS

# designs beyond test_designs.py's that decode: Steerling's bottleneck (with and without concepts),
# MTP heads (training only: the decode step ignores them), sliding windows in both stacks
EXTRA = {
    "steerling-bottleneck-conceptlm": bn_cfg(concept={}),
    "steerling-bottleneck-base": bn_cfg(),
    "archpreview-like-swa-both-stacks": tiny("llama", qk_norm="layer", sliding_window=3, full_attn_every=2,
                                             concept=dict(k=4, code_weights="softmax", rope_scale_by_k=True,
                                                          concept_layers=3)),
}
# the toy strategies of tests/model/toys.py declare nothing: they decode through decode.step
TOYS = ("Alternating23", "PerTokenNext", "CrossAttendCoupling")


def _addresses(st) -> dict:
    return {(name, k): t.data_ptr() for name in ("seg", "cpl", "crc") for k, t in getattr(st, name).items()}


def _check(cfg, lengths=(5, 2, 7, 4), n_new=10) -> str | None:
    """Static steps == the full forward for a ragged batch; returns the refusal instead when refused."""
    model = build(cfg, scale=0.2).double()
    Tp, lengths = max(lengths), list(lengths)
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    with torch.no_grad():
        full = model(seqs).logits  # causal: row b's first n + t + 1 positions are its sequence so far
        _, st = model.prefill(prompt, lengths, max_len=Tp + n_new)
        why = static_refusal(model, st)
        if why is not None:
            return why
        dec = StaticDecoder(model, st)
        for t in range(n_new):
            step = dec.step(torch.stack([seqs[b, n + t] for b, n in enumerate(lengths)]))
            if t == 1:
                held = _addresses(st)  # after the first step a store may have grown once
            if t > 1:
                assert _addresses(st) == held, "a state tensor moved: a CUDA graph would write the old one"
            for b, n in enumerate(lengths):
                assert (step[b] - full[b, n + t]).abs().max() <= 1e-9, (t, b)
        assert st.lengths == [n + n_new for n in lengths] and int(dec.slot) == st.slot == Tp + n_new
    return None


def test_static_step_equals_full_forward_for_every_design() -> None:
    refused = {}
    for name, cfg in {**DESIGNS, **EXTRA}.items():
        why = _check(cfg)
        if why is not None:
            refused[name] = why
    # exactly the designs built on a toy segmenter or coupling fall back, and the reason names it
    toy = {name for name, cfg in DESIGNS.items() if cfg.concept.enabled and (
        cfg.concept.segmentation in ("alt23", "per_token_next") or cfg.concept.coupling == "cross_attend")}
    assert set(refused) == toy and len(toy) > 5, sorted(set(refused) ^ toy)
    assert all(any(t in why for t in TOYS) and "static_decode" in why for why in refused.values()), refused


# tensor methods that read a value back to the host (a sync on a GPU; refused inside a CUDA graph capture)
SYNCS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "any", "all"}


@pytest.mark.parametrize("cfg", [tiny("neox", concept=dict(k=4)),
                                 tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention"))],
                         ids=["conceptlm", "dlcm-cross-attention"])
def test_static_step_has_fixed_shapes_and_reads_no_host_state(cfg) -> None:
    """Two states at different slots run the same ops with the same arguments (tensors by shape,
    everything else by value) and none reads a tensor back to the host: the step's shapes come from
    the capacity alone and its slot from the device tensor (what lets one captured graph serve
    every step). ``decode.step`` fails both (its key length follows the host's slot; DLCM's
    boundaries sync once a step)."""
    model = build(cfg, scale=0.2)
    seqs, prompt = ragged_batch(cfg, [3, 6], 6)
    logs = {"static": [], "decode.step": []}
    with torch.no_grad():
        for steps in (2, 5):  # after the first step (a coupling's store may grow once there, as in the warm-up)
            for kind, log in logs.items():
                _, st = model.prefill(prompt, [3, 6], max_len=12)
                dec = StaticDecoder(model, st)
                for t in range(steps - 1):
                    dec.step(seqs[:, 6 + t])
                seen: list = []
                with _shape_log(seen):
                    static_step(model, st, seqs[:, 9], dec.slot) if kind == "static" else step(model, st, seqs[:, 9])
                log.append(seen)
    a, b = logs["static"]
    assert a == b and len(a) > 50 and not SYNCS & {name for name, _ in a}
    a, b = logs["decode.step"]
    assert a != b


def _sig(a):
    """A call argument with every tensor (also inside tuples and lists) replaced by its shape."""
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), str(a.dtype))
    if isinstance(a, (tuple, list)):
        return tuple(_sig(x) for x in a)
    return repr(a)


class _shape_log:
    """Records (op name, its arguments: tensors' shapes, other values) of every torch call inside the block."""

    def __init__(self, out: list):
        self.out = out

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        out = self.out

        class Log(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                # tensors by shape, anything else (ints, slices, dtypes) by value: a host-side slot
                # would show as an index or a length that differs between the two states
                out.append((getattr(func, "__name__", str(func)), _sig((*args, *(kwargs or {}).values()))))
                return func(*args, **(kwargs or {}))

        self.mode = Log()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
