"""A trained `debug`-size run for the eval / generate / export tests, made once per session.

`ncpctl tokenize` (the real entry point) on a slice of the built-in corpus, then a few
hundred AdamW steps in-process so that scores mean something, saved with
`ncpctl.checkpoint.save_model_files` as run.dir/checkpoints/step_N (+ `latest`).
Both a ConceptLM (the debug recipe's model) and a base model are trained, once per test run for
all xdist workers (tests/shared.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..conftest import run_cli
from ..shared import shared

STEPS = 200
SEQ = 128


def _recipe(root: Path, concept: bool) -> Path:
    p = root / ("concept.yaml" if concept else "base.yaml")
    p.write_text(
        f"run: {{dir: {root / ('concept' if concept else 'base')}}}\n"
        "data: {sources: [builtin:python-stdlib], val_fraction: 0.05, max_documents: 120}\n"
        "tokenizer: {vocab_size: 1024}\n"
        f"model: {{size: debug, max_seq_len: {SEQ}, concept: {{enabled: {str(concept).lower()}}}}}\n"
        "train: {seq_len: 128, micro_batch_size: 8, global_batch_size: 8}\n"
        "eval: {tasks: [ncp_offline], limit: 8}\n"
    )
    return p


def _train(recipe: Path, data_from: Path | None) -> Path:
    from ncpctl.checkpoint import save_model_files
    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe

    r = load_recipe(recipe)
    data = r.data_dir
    if data_from is not None:  # share the tokenized data (and tokenizer) between the runs
        data.parent.mkdir(parents=True, exist_ok=True)
        if not data.exists():
            data.symlink_to(data_from, target_is_directory=True)
    else:
        res = run_cli("tokenize", str(recipe), "--json")
        assert res.returncode == 0, res.stderr
    torch.manual_seed(0)
    model = NCPModel(r.model_config)
    ds = IndexedDataset(data / "train")
    flat = np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(STEPS):
        starts = torch.randint(0, len(flat) - SEQ - 1, (8,), generator=g)
        xy = torch.stack([torch.from_numpy(flat[s : s + SEQ + 1]) for s in starts.tolist()])
        out = model(xy[:, :-1], xy[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    ck = r.run_dir / "checkpoints" / f"step_{STEPS:07d}"
    save_model_files(ck, model, step=STEPS, tokens_seen=STEPS * 8 * SEQ, recipe=r.to_dict(),
                     tokenizer_path=data / "tokenizer.json")
    (r.run_dir / "checkpoints" / "latest").write_text(ck.name + "\n")
    (r.run_dir / "train_loss.json").write_text(json.dumps({"final_ntp_loss": out.ntp_loss.item()}))
    return ck


def make_runs(root: Path) -> None:
    """Train both runs into ``root`` (an empty directory)."""
    torch.set_num_threads(1)  # the test machine has 2 shared cores: more threads only contend
    c = _train(_recipe(root, True), None)
    _train(_recipe(root, False), c.parent.parent / "data")


def shared_runs(factory) -> Iterator[dict[str, Path]]:
    """Generator for the session fixture ``runs``: {"concept": checkpoint dir, "base": checkpoint
    dir, "recipe": concept recipe}, trained once per test run for every xdist worker; read-only
    (a test that evaluates into a run, or changes it, copies it first)."""
    for root in shared(factory, "debug-runs", make_runs, Path(__file__)):
        yield {"concept": root / "concept" / "checkpoints" / f"step_{STEPS:07d}",
               "base": root / "base" / "checkpoints" / f"step_{STEPS:07d}", "recipe": root / "concept.yaml"}


def own_copy(runs: dict[str, Path], kind: str, dst: Path) -> Path:
    """A copy of the shared run ``kind`` (its checkpoint, data link and recipe) at ``dst``, for a test
    that writes into the run (an evaluation's results, request cache and offline task files go to
    run.dir/eval/); returns the copy's checkpoint. ``kind`` "recipe": the concept run, and a recipe
    at ``dst``.yaml whose run.dir is the copy (returned instead)."""
    src = runs["concept" if kind == "recipe" else kind]
    shutil.copytree(src.parent.parent, dst, symlinks=True, ignore=shutil.ignore_patterns("eval"))
    if kind != "recipe":
        return dst / "checkpoints" / src.name
    recipe = dst.with_suffix(".yaml")
    recipe.write_text(runs["recipe"].read_text().replace(str(src.parent.parent), str(dst)))
    return recipe
