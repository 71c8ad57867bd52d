"""The concept bottleneck trained through ``ncpctl pretrain`` on a labelled two-component mixture of
prefixes (``data.mix``, each component's own ``PREFIX.labels.npy``; Steerling's labelled mid-training
mix) at debug size: the loop feeds each row its own component's labels (concept loss, per-component
validation with detection); ``ncpctl eval`` scores the held-out split per component, as training
validates; a component without labels is one error line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ..conftest import RECIPES
from ..data.test_mix_labels import labelled_mix
from .conftest import metrics, ncpctl, result


@pytest.fixture(scope="module")
def mix_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(recipe, run dir) of 2 steps on the prefixes of ``labelled_mix``'s two tokenized components."""
    root = tmp_path_factory.mktemp("mixlabels")
    assert ncpctl("tokenize", str(labelled_mix(root))).returncode == 0
    comp = root / "run" / "mix"
    recipe = root / "bn.yaml"
    recipe.write_text(
        f"extends: {RECIPES / 'debug-bottleneck.yaml'}\nrun: {{dir: {root / 'prefixes'}}}\n"
        f"tokenizer: {{path: {root / 'run' / 'data' / 'tokenizer.json'}}}\ndata:\n  sources: []\n  labels: field\n  mix:\n"
        + "".join(f"    - {{name: {n}, weight: {w}, prefix: {comp / n / 'data' / 'train'}, "
                  f"val_prefix: {comp / n / 'data' / 'val'}}}\n" for n, w in (("a", 0.7), ("b", 0.3)))
        + "model: {max_seq_len: 32, bottleneck: {concepts: 2, rank: 4, teacher_forcing_steps: 2}}\n"
          "train: {max_steps: 2, seq_len: 32, micro_batch_size: 4, global_batch_size: 8, eval_every: 2,"
          " eval_batches: 2, save_every: 2, plots: false, attention_stats_every: 0}\neval: {tasks: []}\n")
    r = result(ncpctl("pretrain", str(recipe), "--json"))
    assert r["step"] == 2 and r["nonfinite_steps"] == 0
    return recipe, root / "prefixes"


def test_the_bottleneck_trains_on_a_labelled_mixture(mix_run: tuple[Path, Path]) -> None:
    _, run = mix_run
    assert all(m["concept_loss"] > 0 for m in metrics(run))
    (val,) = metrics(run, "val")
    assert {"loss/a", "loss/b", "concept_loss/a", "concept_loss/b"} <= set(val)  # each component, with its labels
    names = json.loads((run / "checkpoints" / "step_0000002" / "ncpctl.json").read_text())["concept_names"]
    assert names == ["alpha", "beta"]


def test_eval_scores_a_prefix_mixture_per_component(mix_run: tuple[Path, Path]) -> None:
    """conceptlm_val_ppl (the training distribution's held-out split) on a mixture of prefixes: one
    task per component on its own validation split; the offline ncp_* tasks, which read one tokenized
    corpus, say so in one line instead of pointing at `ncpctl tokenize`."""
    from ncpctl.errors import UserError
    from ncpctl.evaluate.offline import data_dir_for

    _, run = mix_run
    r = result(ncpctl("eval", str(run), "--tasks", "conceptlm_val_ppl", "--limit", "2", "--json"))
    assert set(r["results"]) == {"conceptlm_val_ppl_a", "conceptlm_val_ppl_b"}, r["results"]
    ppl = {k: v["token_perplexity"] for k, v in r["results"].items()}
    assert all(1 < v < 1e4 for v in ppl.values()) and ppl["conceptlm_val_ppl_a"] != ppl["conceptlm_val_ppl_b"]
    with pytest.raises(UserError, match="this checkpoint trained on a data.mix of prefixes") as e:
        data_dir_for(checkpoint=str(run))  # what the ncp_* tasks' datasets call first
    assert len(e.value.problems) == 1 and "conceptlm_val_ppl" in e.value.hint


@pytest.mark.parametrize("damage, message", [
    ("no labels", "has no concept labels"),
    ("another vocabulary", "the label vocabulary differs from the first train dataset's"),
])
def test_a_component_without_its_labels_is_named(mix_run: tuple[Path, Path], tmp_path: Path, damage: str,
                                                 message: str) -> None:
    """A component whose labels are missing, or whose label ids mean other concepts: one line naming it."""
    recipe, _ = mix_run
    comp = recipe.parent / "run" / "mix"
    bare = tmp_path / "bare"
    shutil.copytree(comp / "b" / "data", bare)
    meta = json.loads((bare / "meta.json").read_text())
    if damage == "no labels":
        for f in bare.glob("*.labels.npy"):
            f.unlink()
        del meta["labels"]
    else:
        meta["labels"]["vocabulary"] = meta["labels"]["vocabulary"][::-1]
    (bare / "meta.json").write_text(json.dumps(meta))
    from ncpctl.errors import UserError
    from ncpctl.recipe import load_recipe
    from ncpctl.train.data import open_data
    from ncpctl.train.hooks import Hooks

    # what `ncpctl pretrain` opens before any model work (in-process: no interpreter start)
    r = load_recipe(recipe, [f"run.dir={tmp_path / 'bad'}", f"data.mix=[{{name: a, weight: 1, prefix: "
                             f"{comp}/a/data/train}}, {{name: plain, weight: 1, prefix: {bare}/train}}]"])
    with pytest.raises(UserError) as e:
        open_data(r, 0, 1, Hooks(r), lambda m: None)
    (err,) = e.value.problems
    assert err.startswith("data.mix component 'plain' (train):") and message in err, err
