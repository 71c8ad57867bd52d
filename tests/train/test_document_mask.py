"""data.document_mask through the real ``ncpctl pretrain``: the loop hands the model each window's
document ids from the dataset's index (training and validation), and a model that cannot keep
documents apart is refused before any heavy work, in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
from ncpctl.data.windows import WindowLoader
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe

from .conftest import metrics, ncpctl, result

SETS = ["data.document_mask=true", "train.max_steps=2", "train.eval_every=2", "train.save_every=2"]


def short_documents(tiny_data: Path, out: Path) -> str:
    """The tiny corpus's first 6000 tokens re-cut into documents of 3 to 20 tokens (every window packs
    several): a Megatron dataset prefix."""
    tokens = IndexedDataset(tiny_data / "train").tokens[:6000]
    lengths = np.random.default_rng(0).integers(3, 21, size=600)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), 6000))]
    with IndexedDatasetWriter(out, np.uint16) as w:
        w.add_documents(np.asarray(tokens[: lengths.sum()]), lengths)
    return str(out)


def test_the_logged_validation_loss_is_the_document_masked_one(make_recipe, tiny_data: Path) -> None:
    path = make_recipe("docs")
    prefix = short_documents(tiny_data, path.parent / "short")
    sets = SETS + [f"data.train_prefix={prefix}", f"data.val_prefix={prefix}"]
    result(ncpctl("pretrain", str(path), *[a for s in sets for a in ("--set", s)], "--json"))
    run = path.parent / "docs"
    logged = metrics(run, "val")[-1]["loss"]
    assert all(math.isfinite(r["loss"]) for r in metrics(run))

    from ncpctl.checkpoint import load_model

    model = load_model(run, with_tokenizer=False).model
    r = load_recipe(path, sets)
    val = WindowLoader(IndexedDataset(prefix), r.seq_len, r.global_batch_size, seed=r.train.seed)
    masked, plain = [], []
    with torch.no_grad():
        for _ in range(min(r.train.eval_batches, math.ceil(val.num_windows / r.global_batch_size))):
            windows, docs = torch.from_numpy(next(val)), torch.from_numpy(val.last_documents())
            for w, d in zip(windows.split(r.train.micro_batch_size), docs.split(r.train.micro_batch_size)):
                x, y = model.objective.batch(w)
                masked.append(model(x, y, doc_ids=d).loss.item())
                plain.append(model(x, y).loss.item())
    assert (docs[:, -1] > 0).any()  # the windows do pack several documents
    assert logged == pytest.approx(sum(masked) / len(masked), rel=1e-5)
    assert abs(logged - sum(plain) / len(plain)) > 1e-4  # ... and masking them changes the loss


def test_a_model_that_cannot_keep_documents_apart_is_refused_in_one_line(make_recipe) -> None:
    from ncpctl.train.designs.documents import DocumentHooks

    sets = ["data.document_mask=true", "model.bottleneck.enabled=true", "model.bottleneck.concepts=4"]
    r = load_recipe(make_recipe("bottleneck"), sets)
    with pytest.raises(UserError, match="data.document_mask: model.bottleneck: ") as e:
        DocumentHooks(r)
    assert "\n" not in str(e.value)
    DocumentHooks(load_recipe(make_recipe("fine"), sets[:1]))  # the same model without the bottleneck: accepted
