"""``train.compile`` compiles every block and every depth mixer (``ncpctl.train.compiled``): none of
them may break its graph in any shipped design (a break is a trip back to Python, and on a GPU the
kernels on either side of it no longer fuse). Checked with ``torch._dynamo.explain`` (graph capture
only, no inductor: seconds on a CPU) on the arguments each region receives in a real forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ncpctl.model.core.layers import Stack
from ncpctl.model.core.model import NCPModel
from ncpctl.profile.load import load_for_profile

from ..conftest import RECIPES

torch.set_num_threads(1)

# every design a shipped debug recipe builds (Block AttnRes: Table 3's ablation arm)
DESIGNS = {
    "conceptlm": ("debug.yaml", []),
    "archpreview-irc-crc-mtp": ("debug-archpreview.yaml", []),
    "dlcm": ("debug-dlcm.yaml", []),
    "bottleneck": ("debug-bottleneck.yaml", []),
    "cdlm-bottleneck": ("debug-cdlm-bottleneck.yaml", []),
    "block-attnres": ("debug-archpreview.yaml", ["model.residual=block_attnres", "model.attnres_block=2",
                                                 "model.crc_connections=[]"]),
}


def _snap(a):
    """A mixer's running state as it was at the call (its lists are appended to later)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return dataclasses.replace(a, **{f.name: list(getattr(a, f.name)) for f in dataclasses.fields(a)
                                         if isinstance(getattr(a, f.name), list)})
    return a


def _regions(model: NCPModel) -> list:
    blocks = [blk for stack in model.modules() if isinstance(stack, Stack) for blk in stack]
    return blocks + [m for m in model.modules() if getattr(m, "compile_region", False)]


@pytest.mark.parametrize("design", list(DESIGNS))
def test_no_compiled_region_breaks_its_graph(design: str) -> None:
    path, sets = DESIGNS[design]
    recipe, _ = load_for_profile(RECIPES / path, sets)
    cfg = recipe.model_config
    torch.manual_seed(0)
    model = NCPModel(cfg)
    calls: dict = {}  # one call per kind of region and layer index (a mixer's graph is per layer)

    def capture(mod, args, kwargs):
        key = (type(mod).__name__, getattr(mod.attn, "window", None) if hasattr(mod, "attn") else args[0],
               hasattr(mod, "cross") and mod.cross is not None)
        calls.setdefault(key, (mod, tuple(_snap(a) for a in args), kwargs))

    hooks = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in _regions(model)]
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    model(x[:, :-1], x[:, 1:])
    for h in hooks:
        h.remove()
    assert calls
    breaks = {}
    for key, (mod, args, kwargs) in calls.items():
        torch._dynamo.reset()
        # a mixer's state is mutated by its call: replay it on a copy of what it was given
        args = tuple(_snap(a) for a in args)
        e = torch._dynamo.explain(mod.forward)(*args, **kwargs)
        if e.graph_break_count:
            breaks[key] = [str(b.reason) for b in e.break_reasons]
    assert not breaks, breaks
