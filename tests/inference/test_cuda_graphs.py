"""CUDA-graph decoding (ncpctl/inference/cuda_graphs.py) without a GPU: the runner's bookkeeping
under an emulated graph that keeps CUDA graphs' rules (a capture runs nothing and returns the
buffers a replay rewrites; a replay reruns the captured step on the same state), its fallbacks, and
``generate``'s wiring on a (pretended) CUDA device. That the captured step is the same kernels on the
same buffers at every slot is tests/model/test_decode_static.py's part; the real capture runs in
bench/gpu_check.py's decode section."""

from __future__ import annotations

import pytest
import torch

from ncpctl.inference import SamplingParams, cuda_graphs, generate
from ncpctl.inference.cuda_graphs import GraphedSteps
from ncpctl.model.core.interventions import AddToDecoderInput

from ..model._helpers import build, ragged_batch, tiny

torch.set_num_threads(1)


def _tensors(st, steps: GraphedSteps) -> list[torch.Tensor]:
    """Every tensor a step writes: caches, per-row state, the device slot."""
    caches = [t for c in (*st.enc, *st.dec, *st.con) for t in (c.k, c.v)]
    return caches + [t for n in ("seg", "cpl", "crc") for t in getattr(st, n).values()] + [steps.slot]


class FakeGraph:
    """A replay reruns the captured function and writes its outputs into the captured buffers."""

    def __init__(self, fn, out, steps: GraphedSteps):
        self.fn, self.out, self.steps, self.replays = fn, out, steps, 0

    def replay(self) -> None:
        logits, _ = self.fn()
        self.out[0].copy_(logits)
        self.steps.hidden.copy_(self.steps.state.hidden)  # the graph's hidden buffer
        self.replays += 1


def emulated(steps: GraphedSteps):
    """``record`` with CUDA graphs' rule that a capture runs nothing: the function runs (for its
    outputs) and every tensor it wrote is put back."""
    def record(fn):
        saved = [t.clone() for t in _tensors(steps.state, steps)]
        out = fn()
        for t, s in zip(_tensors(steps.state, steps), saved):
            t.copy_(s)
        out[0].fill_(float("nan"))  # a captured buffer holds nothing until a replay
        return FakeGraph(fn, out, steps), out

    return record


def _setup(cfg, lengths=(5, 2, 7, 4), n_new=9):
    model = build(cfg, scale=0.2)
    seqs, prompt = ragged_batch(cfg, list(lengths), n_new)
    with torch.no_grad():
        full = model(seqs).logits
    return model, seqs, prompt, full


@pytest.mark.parametrize("cfg", [tiny("neox", concept=dict(k=4)),
                                 tiny("llama", concept=dict(segmentation="dynamic", coupling="cross_attention"))],
                         ids=["conceptlm", "dlcm-cross-attention"])
def test_graphed_steps_equal_the_full_forward(cfg) -> None:
    lengths, n_new = [5, 2, 7, 4], 9
    model, seqs, prompt, full = _setup(cfg, lengths, n_new)
    with torch.no_grad():
        _, st = model.prefill(prompt, lengths, max_len=max(lengths) + n_new)
        gs = GraphedSteps(model, st, warmup=lambda fn: fn())
        gs.record = emulated(gs)
        assert gs.eager_reason is None
        for t in range(n_new):
            got = gs.step(torch.stack([seqs[b, n + t] for b, n in enumerate(lengths)]))
            for b, n in enumerate(lengths):
                assert (got[b] - full[b, n + t]).abs().max() <= 1e-5, (t, b)
            assert st.hidden is gs.hidden if t > 0 else True  # the graph's buffer after each replay
        assert gs.graph.replays == n_new - 1 and st.slot == max(lengths) + n_new  # one eager warm-up step
        with pytest.raises(ValueError, match="full"):
            gs.step(seqs[:, 0])


def test_a_failed_capture_warns_once_and_decodes_eagerly() -> None:
    cfg = tiny("neox", concept=dict(k=4))
    lengths, n_new = [3, 6], 7
    model, seqs, prompt, full = _setup(cfg, lengths, n_new)
    with torch.no_grad():
        _, st = model.prefill(prompt, lengths, max_len=max(lengths) + n_new)
        gs = GraphedSteps(model, st, warmup=lambda fn: fn())

        def broken(fn):
            st.hidden = None  # what the capture's Python side left behind must not survive it
            emulated(gs)(fn)
            raise RuntimeError("operation not permitted when stream is capturing")

        gs.record = broken
        with pytest.warns(RuntimeWarning, match="capture failed.*not permitted") as caught:
            outs = [gs.step(torch.stack([seqs[b, n + t] for b, n in enumerate(lengths)])) for t in range(n_new)]
    assert len(caught) == 1 and gs.graph is None and gs.eager_reason.startswith("CUDA graph capture failed")
    for t, got in enumerate(outs):  # the warm-up step, then model.decode_step from the untouched state
        assert all((got[b] - full[b, n + t]).abs().max() <= 1e-5 for b, n in enumerate(lengths)), t


def test_refused_states_decode_eagerly() -> None:
    cfg = tiny("neox", concept=dict(k=4))
    model, seqs, prompt, _ = _setup(cfg, (4, 4))
    with torch.no_grad():
        _, st = model.prefill(prompt, [4, 4], max_len=None)
        assert "grow" in GraphedSteps(model, st).eager_reason
        ivs = [AddToDecoderInput(vector=torch.ones(cfg.d_model))]
        _, st = model.prefill(prompt, [4, 4], max_len=12, interventions=ivs)
        assert "interventions" in GraphedSteps(model, st).eager_reason


def test_generate_replays_graphs_on_cuda(monkeypatch) -> None:
    """``generate`` on a CUDA device wraps the cached decoding in graphed steps; greedy tokens are
    those of the eager path (the device is pretended: ``wanted`` says yes, the graph is emulated)."""
    cfg = tiny("neox", concept=dict(k=4))
    model, seqs, prompt, _ = _setup(cfg, (5, 3), 12)
    prompts = [seqs[0, :5].tolist(), seqs[1, :3].tolist()]
    params = SamplingParams(max_new_tokens=12, greedy=True)
    eager = generate(model, prompts, params, str)
    made: list[GraphedSteps] = []
    real = GraphedSteps.__init__

    def init(self, model, st, **kw):
        real(self, model, st, warmup=lambda fn: fn())
        self.record = emulated(self)
        made.append(self)

    monkeypatch.setattr(cuda_graphs, "wanted", lambda device: True)
    monkeypatch.setattr(GraphedSteps, "__init__", init)
    graphed = generate(model, prompts, params, str)
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    assert len(made) == 1 and made[0].graph.replays == 10  # 12 tokens: the prefill's, a warm-up, 10 replays
