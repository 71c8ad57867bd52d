"""The concept bottleneck trained through ``ncpctl pretrain`` on a labelled two-component mixture
(``data.mix`` + ``data.labels``, Steerling's labelled mid-training mix) at debug size: the loop feeds
each row its own component's labels (concept loss, per-component validation with detection), and a
component without labels is one error line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..conftest import RECIPES
from ..data.test_mix_labels import labelled_mix
from .conftest import metrics, ncpctl, result


def test_the_bottleneck_trains_on_a_labelled_mixture(tmp_path: Path) -> None:
    mix = labelled_mix(tmp_path)
    recipe = tmp_path / "bn.yaml"
    recipe.write_text(f"extends: {RECIPES / 'debug-bottleneck.yaml'}\n"
                      + mix.read_text().replace("data:\n", "data:\n  sources: []\n")
                      + "model: {max_seq_len: 32, bottleneck: {concepts: 2, rank: 4, teacher_forcing_steps: 2}}\n"
                        "train: {max_steps: 2, seq_len: 32, micro_batch_size: 4, global_batch_size: 8, eval_every: 2,"
                        " eval_batches: 2, save_every: 2, plots: false, attention_stats_every: 0}\neval: {tasks: []}\n")
    assert ncpctl("tokenize", str(recipe)).returncode == 0
    r = result(ncpctl("pretrain", str(recipe), "--json"))
    run = tmp_path / "run"
    assert r["step"] == 2 and r["nonfinite_steps"] == 0
    assert all(m["concept_loss"] > 0 for m in metrics(run))
    (val,) = metrics(run, "val")
    assert {"loss/a", "loss/b", "concept_loss/a", "concept_loss/b"} <= set(val)  # each component, with its labels
    names = json.loads((run / "checkpoints" / "step_0000002" / "ncpctl.json").read_text())["concept_names"]
    assert names == ["alpha", "beta"]

    # a component without labels: one line naming it, before any training
    bare = tmp_path / "bare"
    shutil.copytree(run / "mix" / "b" / "data", bare)
    for f in bare.glob("*.labels.npy"):
        f.unlink()
    meta = json.loads((bare / "meta.json").read_text())
    del meta["labels"]
    (bare / "meta.json").write_text(json.dumps(meta))
    bad = ncpctl("pretrain", str(recipe), "--set", f"run.dir={tmp_path / 'bad'}", "--set",
                 f"data.mix=[{{name: a, weight: 1, prefix: {run}/mix/a/data/train}}, "
                 f"{{name: plain, weight: 1, prefix: {bare}/train}}]")
    assert bad.returncode == 2
    (err,) = [x for x in bad.stderr.splitlines() if x.startswith("error: ")]
    assert "data.mix component 'plain' (train):" in err and "has no concept labels" in err, bad.stderr
