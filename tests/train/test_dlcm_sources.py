"""DLCM Table 5 during training: a model with learned segments reports validation tokens per
concept per ``data.sources`` entry (``tokens_per_concept/<source>``), and each equals the ratio
recomputed from the checkpoint over the same validation windows with every token's source taken
from the documents' order (``documents_per_source``), not from the loop's SourceMap; and
``ncpctl eval CKPT --concepts`` without corpora reports the same split per source."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import torch

from ..conftest import RECIPES
from .conftest import ENV, metrics, ncpctl, result


def _corpora(root: Path) -> tuple[Path, Path]:
    """Two small corpora of different texture: Python-like lines and word prose."""
    code, prose = root / "code", root / "prose"
    code.mkdir()
    prose.mkdir()
    rng = random.Random(0)
    names = ["alpha", "beta", "gamma", "delta", "value", "index", "total", "count"]
    for i in range(30):
        lines = [f"def f{i}_{j}({rng.choice(names)}, {rng.choice(names)}):\n    return {rng.choice(names)} + {j}\n"
                 for j in range(40)]
        (code / f"m{i}.py.txt").write_text("".join(lines))
    words = "the river of a city and people in winter music garden story morning ocean".split()
    for i in range(30):
        (prose / f"p{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(600)) + ".\n")
    return code, prose


def test_validation_reports_tokens_per_concept_per_source(tmp_path: Path) -> None:
    code, prose = _corpora(tmp_path)
    run = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {RECIPES / 'debug-dlcm.yaml'}\nrun: {{dir: {run}}}\n"
                      f"data: {{sources: ['{code}/*.txt', '{prose}/*.txt'], val_fraction: 0.2}}\n"
                      "tokenizer: {vocab_size: 512}\nmodel: {max_seq_len: 64}\n"
                      "train: {max_steps: 4, seq_len: 64, micro_batch_size: 4, global_batch_size: 8, eval_every: 4,"
                      " eval_batches: 6, save_every: 4, plots: false}\n")
    assert ncpctl("tokenize", str(recipe)).returncode == 0
    res = result(ncpctl("pretrain", str(recipe), "--json"))
    assert res["step"] == 4
    val = metrics(run, "val")[-1]
    per = {k.split("/", 1)[1]: v for k, v in val.items() if k.startswith("tokens_per_concept/")}
    assert set(per) == {"code_txt", "prose_txt"}, val

    # the reference: the checkpoint in eval mode over the loop's validation windows
    from ncpctl.checkpoint import load_model
    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.data.windows import WindowLoader

    torch.set_num_threads(int(ENV["OMP_NUM_THREADS"]))
    meta = json.loads((run / "data" / "meta.json").read_text())
    ds = IndexedDataset(run / "data" / "val")
    counts = meta["splits"]["val"]["documents_per_source"]
    src_of_token = np.repeat(np.repeat(np.arange(len(counts)), counts), np.asarray(ds.sizes))  # (num_tokens,)
    model = load_model(Path(res["checkpoint"])).model.eval()
    T, G = 64, 8
    loader = WindowLoader(ds, T, G, seed=_seed(run))
    tokens, concepts = np.zeros(2), np.zeros(2)
    with torch.no_grad():
        for _ in range(min(6, math.ceil(loader.num_windows / G))):
            x = torch.from_numpy(next(loader))[:, :-1]
            closed = model(x).concept.segments.closed  # (G, T)
            starts = torch.ones_like(closed, dtype=torch.bool)
            starts[:, 1:] = closed[:, 1:] != closed[:, :-1]
            src = src_of_token[loader.last_ids[:, None] * T + np.arange(T)]
            np.add.at(tokens, src, 1)
            np.add.at(concepts, src, starts.numpy())
    for i, name in enumerate(meta["source_labels"]):
        # a boundary p within float error of 0.5 may flip between two processes: one in ~4000 tokens
        assert math.isclose(per[name], tokens[i] / concepts[i], rel_tol=2e-3), (name, per[name], tokens[i] / concepts[i])
    assert per["code_txt"] != per["prose_txt"]

    # ncpctl eval CKPT --concepts without --heldout: Table 5 on this validation split, one corpus per
    # source, each that source's tokens (from documents_per_source) cut into windows of the model's length
    rep = result(ncpctl("eval", res["checkpoint"], "--concepts", "--json"))
    by = rep["tokens_per_concept_by_source"]
    assert list(by) == meta["source_labels"] and rep["corpora"].startswith("validation split")
    sizes = np.asarray(ds.sizes)
    for i, name in enumerate(meta["source_labels"]):
        n = int(sizes[sum(counts[:i]):sum(counts[:i + 1])].sum())
        assert by[name]["tokens"] == min(n // T, 600) * T and 0 < by[name]["concepts"] <= by[name]["tokens"]


def _seed(run: Path) -> int:
    """train.seed of the run (its resolved recipe)."""
    import yaml

    return int(yaml.safe_load((run / "recipe.resolved.yaml").read_text())["train"]["seed"])

