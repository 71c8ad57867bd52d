"""``train.compile`` (``ncpctl.train.compiled``): the compiled blocks give eager mode's loss and
gradients for ConceptLM, NCP-ArchPreview (IRC, CRC, MTP), DLCM and the bottleneck; where the blocks
cannot compile, one warning line says why and the model stays eager.

The suite compiles with dynamo's ``eager`` backend (the graph capture of every block, ~1-5 s per
design); inductor itself costs ~56 s of compilation at debug size on one busy core, so its check
(the first loss within 1e-6 of eager) is in bench/memory.py's ``compile`` arm, not in the suite."""

from __future__ import annotations

import copy

import pytest
import torch

from ncpctl.model.model import NCPModel
from ncpctl.recipe import load_recipe
from ncpctl.train.compiled import compile_blocks

from ..conftest import RECIPES

DESIGNS = {"conceptlm": "debug.yaml", "archpreview": "debug-archpreview.yaml", "dlcm": "debug-dlcm.yaml",
           "bottleneck": "debug-bottleneck.yaml"}


def _loss_and_grads(model: NCPModel, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 100, (2, 33), generator=g)
    extra = {"concept_labels": torch.rand(2, 32, 16, generator=g) < 0.1} if model.bottleneck is not None else {}
    torch.manual_seed(2)  # the bottleneck's dropout: the same mask both times
    loss = model(batch[:, :-1], batch[:, 1:], sample_ids=torch.arange(2), **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(design: str, backend: str, tol: float) -> int:
    recipe = load_recipe(RECIPES / DESIGNS[design], ["model.max_seq_len=64", "train.seq_len=32"])
    torch.manual_seed(0)
    model = NCPModel(recipe.model_config).train()
    compiled = copy.deepcopy(model)
    n = compile_blocks(compiled, 0, False, pytest.fail, backend=backend)
    (loss, grads), (closs, cgrads) = _loss_and_grads(model), _loss_and_grads(compiled)
    assert cgrads.keys() == grads.keys()
    assert abs(closs - loss).item() <= tol * max(1.0, abs(loss).item()), (design, closs, loss)
    worst = max((cgrads[k] - grads[k]).abs().max().item() for k in grads)
    assert worst <= tol, (design, worst)
    return n


@pytest.mark.parametrize("design", list(DESIGNS))
def test_compiled_blocks_equal_eager(design: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert _compare(design, "eager", 0.0) >= 4  # every block of every stack was compiled
    assert counters["stats"]["unique_graphs"] >= 1  # and dynamo captured graphs (not all skipped)


def test_where_blocks_cannot_compile_one_line_says_why_and_the_model_stays_eager(monkeypatch) -> None:
    recipe = load_recipe(RECIPES / "debug.yaml", ["model.max_seq_len=64", "train.seq_len=32"])
    model = NCPModel(recipe.model_config)
    lines: list[str] = []
    assert compile_blocks(model, 3, False, lines.append) == 0
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    assert compile_blocks(model, 0, False, lines.append) == 0
    assert lines == ["train.compile: running eagerly: ZeRO-3 gathers each module's weights in hooks around its "
                     "forward, which torch.compile does not trace",
                     "train.compile: running eagerly: inductor needs a C++ compiler on the CPU and "
                     "no-such-c++-compiler is not on PATH"]
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules())
