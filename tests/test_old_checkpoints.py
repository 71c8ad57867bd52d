"""Checkpoints written before the staged-model redesign (tests/fixtures/README.md) still load
with the same logits, evaluate and export through the real CLI. The llama fixture has
``add: normed``, whose norms moved from ``concept.norm_h`` to ``concept.coupling.norm_h``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ncpctl.checkpoint import load_model

from .conftest import REPO, run_cli

FIXTURES = REPO / "tests" / "fixtures"
NAMES = ["neox", "llama"]


def _copy(name: str, tmp_path: Path) -> Path:
    """A copy, so that nothing writes into the committed fixture."""
    return Path(shutil.copytree(FIXTURES / f"ckpt_v1_{name}", tmp_path / name))


@pytest.mark.parametrize("name", NAMES)
def test_loads_with_the_same_logits(name):
    loaded = load_model(FIXTURES / f"ckpt_v1_{name}")
    ref = load_file(str(FIXTURES / f"ckpt_v1_{name}" / "reference_logits.safetensors"))
    with torch.no_grad():
        got = loaded.model(ref["tokens"]).logits[..., : loaded.config.vocab_size]
    assert (got - ref["logits"]).abs().max() <= 1e-5


def _with_validation_data(ck: Path, tmp_path: Path) -> None:
    """The offline tasks read the run's validation split, which the fixtures do not carry (their
    recipe names the run directory they were trained in, /tmp/fx/NAME, gone on another machine):
    tokenize a small one with the fixture's own tokenizer and point the copy's recipe at it."""
    run = tmp_path / "run"
    recipe = tmp_path / "tok.yaml"
    recipe.write_text("data:\n  sources: [builtin:python-stdlib]\n  max_documents: 40\n  val_fraction: 0.25\n"
                      f"tokenizer:\n  path: {ck / 'tokenizer.json'}\nrun:\n  dir: {run}\n")
    r = run_cli("tokenize", str(recipe))
    assert r.returncode == 0, r.stderr[-2000:]
    meta_path = ck / "ncpctl.json"
    meta = json.loads(meta_path.read_text())
    meta["recipe"]["run"]["dir"] = str(run)
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("name", NAMES)
def test_evaluates_and_exports(name, tmp_path):
    ck = _copy(name, tmp_path)
    _with_validation_data(ck, tmp_path)
    r = run_cli("eval", str(ck), "--tasks", "ncp_offline", "--limit", "3", "--out", str(tmp_path / "eval"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["ok"] and list((tmp_path / "eval").glob("results_*.json"))
    r = run_cli("export", str(ck), "--out", str(tmp_path / "hf"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["verify"]["max_abs_diff"] <= 1e-4

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32).eval()
    ref = load_file(str(ck / "reference_logits.safetensors"))
    with torch.no_grad():
        got = hf(input_ids=ref["tokens"]).logits[..., : ref["logits"].shape[-1]]
    assert (got - ref["logits"]).abs().max() <= 1e-5
