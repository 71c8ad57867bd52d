"""``train.activation_checkpointing`` (``ncpctl.train.recompute``) and ``train.compile``
(``ncpctl.train.compiled``): full, selective and compiled blocks give the same loss and gradients as
eager inside the DeepSpeed engine for ConceptLM, NCP-ArchPreview (IRC, CRC, MTP; AdamW at ZeRO-3,
which refuses Muon), DLCM and the Steerling bottleneck (dropout on) at ZeRO 0 and 3; checkpointing
really recomputes (the attention projections run twice per step), compile really captures graphs
(dynamo's ``eager`` backend here; inductor's kernels in ``test_compile.py``) with no graph break,
also at ZeRO-3 where every weight is partitioned; the swap leaves names, the state dict and
decoding alone."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ncpctl.model.core.model import NCPModel
from ncpctl.recipe import load_recipe
from ncpctl.train.recompute import apply_activation_checkpointing

from ..conftest import RECIPES
from .conftest import ENV


def test_checkpointing_and_compile_equal_eager_for_every_design_at_zero_0_and_3() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.train.recompute_step", "--stages", "0", "3",
                           "--modes", "full", "selective", "compile"], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["design"], r["stage"]) for r in rows] == [(d, s) for d in ("conceptlm", "archpreview", "dlcm",
                                                                          "bottleneck") for s in (0, 3)]
    for r in rows:
        for mode in ("full", "selective"):
            got = r[mode]
            assert got["loss"] <= 1e-6 and got["grad"] <= 1e-6, (r["design"], r["stage"], mode, got)
            assert got["qkv_calls"] == 2 * r["qkv_calls"], (r["design"], mode)  # recomputed, not skipped
        got = r["compile"]
        assert got["loss"] <= 1e-6 and got["grad"] <= 1e-6, (r["design"], r["stage"], got)
        assert got["graph_calls"] > 0 and got["graph_breaks"] == 0, (r["design"], r["stage"], got)
        released, params = got["released"]  # ZeRO-3 on one rank: every weight partitioned, gathered by hooks
        assert released == (params if r["stage"] == 3 else 0), (r["design"], r["stage"], got)


def test_the_swap_keeps_names_and_state_and_decodes_as_before() -> None:
    recipe = load_recipe(RECIPES / "debug.yaml", ["model.max_seq_len=64", "train.seq_len=32"])
    torch.manual_seed(0)
    model = NCPModel(recipe.model_config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        eager = model(idx).logits
    assert apply_activation_checkpointing(model, "selective") == 2 * 6  # attn + mlp of 6 blocks (no cross sub-layer)
    assert apply_activation_checkpointing(model, "full") == 6
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.decoder[0]).__name__ == "Block" and getattr(model.decoder[0], "recomputed", False)
    with torch.no_grad():
        assert torch.equal(model(idx).logits, eager)
    assert sum(getattr(m, "recomputed", False) for m in model.modules()) == 6  # full replaced selective
    assert apply_activation_checkpointing(model, "none") == 0
    assert not any(getattr(m, "recomputed", False) for m in model.modules())
