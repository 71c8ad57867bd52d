"""``train.compile`` (``ncpctl.train.compiled``): inductor's compiled blocks give eager mode's loss
and gradients within 1e-6 (fp32) inside the DeepSpeed engine at ZeRO 0 and 3; where the blocks
cannot compile, one warning line says why and the model stays eager.

Every design (ConceptLM, NCP-ArchPreview, DLCM, the bottleneck) is compiled at ZeRO 0 and 3 with
dynamo's ``eager`` backend (the graph capture alone) in ``test_recompute.py``'s launch. Inductor
here is ConceptLM's alone: its cost is g++ building the C++ kernels (~30 s for the token and concept
blocks' forward and backward on one busy core, whatever the width; ~10 s once inductor's on-disk cache
holds them), and the other designs' blocks are the same layers in other arrangements."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ncpctl.model.core.model import NCPModel
from ncpctl.recipe import load_recipe
from ncpctl.train.compiled import compile_blocks, why_not

from ..conftest import RECIPES
from .conftest import ENV


@pytest.mark.skipif(why_not(on_gpu=False) is not None, reason=f"no inductor on this CPU: {why_not(on_gpu=False)}")
def test_inductor_blocks_equal_eager_at_zero_0_and_3() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.train.recompute_step", "--stages", "0", "3", "--modes",
                           "compile", "--backend", "inductor", "--designs", "conceptlm"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == [0, 3]
    for r in rows:
        got = r["compile"]
        assert got["loss"] <= 1e-6 and got["grad"] <= 1e-6, (r["stage"], got)  # kernels reorder sums: not bit-exact
        assert got["graph_calls"] > 0 and got["graph_breaks"] == 0, (r["stage"], got)
    assert rows[1]["compile"]["released"][0] == rows[1]["compile"]["released"][1]  # ZeRO-3 partitioned every weight


def test_without_a_cxx_compiler_one_line_says_why_and_the_model_stays_eager(monkeypatch) -> None:
    recipe = load_recipe(RECIPES / "debug.yaml", ["model.max_seq_len=64", "train.seq_len=32"])
    model = NCPModel(recipe.model_config)
    lines: list[str] = []
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    assert compile_blocks(model, 3, False, lines.append) == 0
    assert lines == ["train.compile: running eagerly: inductor needs a C++ compiler on the CPU and "
                     "no-such-c++-compiler is not on PATH"]
    assert not any("forward" in vars(m) or getattr(m, "_z3_leaf", False) for m in model.modules())
    assert compile_blocks(model, 3, False, pytest.fail, backend="eager") == 6  # the graph capture needs no compiler
    assert all(getattr(blk, "_z3_leaf", False) for blk in model.decoder)  # ZeRO-3 gathers a block at once
