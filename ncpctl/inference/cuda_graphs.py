"""Decoding steps replayed as one CUDA graph (issue 45 item 5).

A cached decode step of pythia-160m is ~250 small kernels launched from Python: the first H200
run measured 0.8 ms of kernels in 6-11 ms of wall time per step (docs/gpu/README.md). The static
step (ncpctl/model/core/decode_static.py: fixed shapes, the write index on the device, no host sync)
is captured once per generation and replayed for every later token, so a step costs one launch.

``GraphedSteps`` runs the steps of one decode state: the first step eagerly (on a side stream, as
PyTorch's CUDA-graph notes ask: libraries allocate their workspaces, a coupling's store reaches its
final size, the RoPE table its length), the second is captured and then replayed, as is every
later one. The new tokens are copied into one static input buffer; the logits come out of the
graph's output buffer, copied (the next replay overwrites it). A state the static step refuses
(``static_refusal``: interventions, caches without a capacity, a strategy that does not declare
``static_decode``) decodes with ``model.decode_step`` instead, silently; a capture that fails (an
op that syncs or is not capturable) warns once and decodes eagerly from there, the state untouched
(a capture runs nothing).

Generation uses it on CUDA (``generate`` wraps the objective's ``CachedDecoding``) while ``ENABLED``
holds; ``bench/gpu_check.py`` turns it off to time the eager step beside it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from ncpctl.model.core.decode_static import static_refusal, static_step

ENABLED = True  # generation on CUDA replays the decode step as a CUDA graph


def wanted(device: torch.device) -> bool:
    """Whether generation on ``device`` replays its decode steps as a CUDA graph."""
    return ENABLED and device.type == "cuda"


def side_stream(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a side stream that the current stream then waits for (warm-up before a capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return out


def capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """(a CUDA graph of ``fn``'s kernels, ``fn``'s outputs: the buffers each replay rewrites). The
    kernels are recorded, not run."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _state_ids(st) -> dict:
    return {(name, k): id(t) for name in ("seg", "cpl", "crc") for k, t in getattr(st, name).items()}


class GraphedSteps:
    """The decode steps of ``st`` (after ``model.prefill``), replayed as one CUDA graph where the
    static step can run; ``eager_reason`` says why not (None: graphed)."""

    def __init__(self, model, st, *, warmup: Callable | None = None, record: Callable | None = None):
        """``warmup(fn)`` runs the first step (default ``side_stream``), ``record(fn)`` captures
        (default ``capture``): what a test without a GPU replaces."""
        self.model, self.state = model, st
        self.warmup, self.record = warmup or side_stream, record or capture
        self.eager_reason = static_refusal(model, st)
        self.graph: Any = None
        self.steps = 0
        if self.eager_reason is None:
            dev = st.pad_t.device
            self.slot = torch.tensor(st.slot, device=dev)  # the device's write index, advanced by the step
            self.tokens = torch.zeros(len(st.pad), dtype=torch.long, device=dev)  # the graph's input

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (B,) -> next-token logits (B, V), as ``model.decode_step``."""
        st = self.state
        if self.eager_reason is not None:
            return self.model.decode_step(st, tokens)
        if st.slot >= st.capacity:
            raise ValueError(f"decode state is full ({st.capacity} slots); prefill with a larger max_len")
        self.tokens.copy_(tokens)
        run = lambda: static_step(self.model, st, self.tokens, self.slot)  # noqa: E731
        if self.graph is None and self.steps == 0:
            logits, _ = self.warmup(run)
        else:
            if self.graph is None and not self._capture(run):
                return self.step(tokens)  # decodes eagerly from here (eager_reason is set)
            self.graph.replay()
            st.hidden = self.hidden
            logits = self.out.clone()
        st.slot += 1
        self.steps += 1
        return logits

    def _capture(self, run: Callable[[], Any]) -> bool:
        """Capture the static step; on failure restore what the capture's Python side set, warn once
        and switch to eager steps (a capture runs no kernel: the state's values are untouched)."""
        st = self.state
        held = {name: dict(getattr(st, name)) for name in ("seg", "cpl", "crc")}
        ids, hidden = _state_ids(st), st.hidden
        try:
            self.graph, (self.out, kept) = self.record(run)
            if not kept or _state_ids(st) != ids:
                raise RuntimeError("a state tensor changed its shape during the capture")
            self.hidden = st.hidden
            return True
        except Exception as e:  # an op that syncs or cannot be captured: eager steps, never a failed generation
            for name, d in held.items():
                setattr(st, name, d)
            st.hidden, self.graph = hidden, None
            self.eager_reason = f"CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            warnings.warn(f"{self.eager_reason}; decoding without CUDA graphs", RuntimeWarning, stacklevel=3)
            return False


class GraphedDecoding:
    """An objective's ``CachedDecoding`` (``logits``, ``step``) whose steps are ``GraphedSteps``."""

    def __init__(self, cached):
        self.logits = cached.logits
        self.steps = GraphedSteps(cached.model, cached.state)

    @property
    def state(self):
        return self.steps.state

    def step(self, tokens: torch.Tensor) -> None:
        self.logits = self.steps.step(tokens)
